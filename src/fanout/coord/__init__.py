"""fanout.coord."""
