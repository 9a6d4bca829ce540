"""On-policy data: the verifier rewrites the assistant turns its drafts learn from.

    fanout regenerate --verifier-name-or-path DIR --data chats.jsonl --out regen/

`engine` (RegenOptions, requests and answers, per-record seeds), `hf` (the embedded
batched engine), `openai` (any OpenAI-compatible server), `shards` (the output
directory: manifest, atomic shards, resume), `regenerate` (the driver and the command).

May import: data, model, ops and the core. Never a role: `fanout produce --regenerate`
imports regen, not the other way round.
"""
