"""The trainer role (`fanout train`, `fanout eval`): read windows, train a draft, serve it.

Owns: reading a run as one consumer with prefetch and verified reads (consumer),
the training loop (trainer), its AdamW and LR schedule (optim), the stream's length
that schedule decays over (plan), what it tells the operator: wait notices, progress
bar, start-up line, metrics log (progress), data parallelism (distributed),
checkpoints in the speculators layout (checkpoint), and speculative-decoding
evaluation of drafts (eval).

May import: coord, store, data, model, ops and the core. Never the producer side
(produce/).
"""
