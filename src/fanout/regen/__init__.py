"""On-policy data: the verifier rewrites the assistant turns its drafts learn from.

    fanout regenerate --verifier-name-or-path DIR --data chats.jsonl --out regen/

`engine` (RegenOptions, requests and answers, per-record seeds), `hf` (the embedded
batched engine), `openai` (any OpenAI-compatible server), `shards` (the output
directory: manifest, atomic shards, resume), `regenerate` (the driver and the command).
"""
