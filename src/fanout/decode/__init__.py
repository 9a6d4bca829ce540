"""Speculative decoding with trained drafts (`fanout eval`): it trains nothing.

Owns: the serving loop of every draft family, lossless against plain decoding
(spec_decode; rejected draft tokens undone in every layer's state of the verifier:
rollback), `fanout eval`'s held-out comparison of drafts and its table (eval), and
the model card written beside a checkpoint (model_card). Each family's own drafting
step lives in its folder (fanout.families.<name>); the loop calls it through the
family registry.

May import: data, checkpoints, families, model, ops and the core. Never a role (train/, produce/,
coord/, store/).
"""
