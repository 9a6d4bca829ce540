"""The trainer role (`fanout train`): read windows, train a draft of any family.

Owns: reading a run as one consumer with prefetch and verified reads (consumer),
the training loop (trainer), its AdamW and LR schedule (optim), the stream's length
that schedule decays over (plan), what it tells the operator: wait notices, progress
bar, start-up line, metrics log (progress), data parallelism (distributed),
checkpoints and their exact-resume state (checkpoint). The draft itself is its
family's (fanout.families); `--eval-every` decodes with fanout.decode.

May import: coord, store, regen, decode, data, checkpoints, families, model, ops and the core. Never the producer side
(produce/).
"""
