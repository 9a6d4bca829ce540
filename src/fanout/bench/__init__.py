"""fanout.bench.bench."""
