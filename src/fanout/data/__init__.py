"""The data stage: chat files → packed, loss-masked token rows, cached (`fanout prepare`).

Owns: reading chat data (chat), chat templates and their loss masks (chatspec,
template, masks, maskers), the worker pool that uses every core (workers), best-fit
packing (packing), the fingerprinted row cache (cache), the stage's driver and config
(prepare), and the token counts behind reduced draft vocabularies (draft_vocab).

May import: model, ops and the core (errors, contract, flags, filesystem). Workers
render templates with jinja2 and never import torch or transformers.
"""
