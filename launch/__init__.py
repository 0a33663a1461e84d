"""Command-line entry points and scheduler back ends."""
