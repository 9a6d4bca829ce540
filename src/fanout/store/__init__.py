"""fanout.store.store."""
