"""fanout.data."""
