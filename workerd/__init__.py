"""gyre.workerd."""
