from gyre.cli.main import main

main()
