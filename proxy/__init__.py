"""gyre.proxy."""
