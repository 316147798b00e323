"""keys.py: the CURVE key helpers' old home, kept for `gyre keys` (cli/main.py) only.

They live in coordinator/keys.py now; import them from there.
"""

from gyre.coordinator.keys import KeyFileError, add_worker, client_keys, init_keys, server_keys

__all__ = ["KeyFileError", "add_worker", "client_keys", "init_keys", "server_keys"]
