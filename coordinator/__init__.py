"""gyre.coordinator."""
