"""gyre.cli."""
