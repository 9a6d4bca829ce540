"""fanout.train.trainer."""
