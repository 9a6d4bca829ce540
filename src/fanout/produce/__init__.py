"""fanout.produce."""
