"""The sandbox-supervisor daemon."""
