"""Draft families: one folder per family, one registry name each.

    from fanout.families.registry import FAMILIES, family
    fam = family("dflash2")                   # ConfigError naming the known ones
    draft = fam.build(verifier_dir, **fields)  # its model, from its validated config

A family owns, in its folder, a set of parts (`base.Family` lists them): its config
(defaults = its reference recipe) and flags, its model and loss (built from the shared
parts in fanout.model: the block or chain backbone, the draft attention, the loss
parts), its drafting step (`Family.context`, which `fanout eval` calls) and its export
adapter (what its checkpoint writes in speculators' names). No family's folder imports
another's (tests/test_family_seam.py). The trainer loop, consumer stream, optimizer,
fused CE, checkpointing and lifecycle are shared; the checkpoint layout every family
shares (markers, format check, save, resume, the reader) is fanout.checkpoints, one
layer up, and the layer numbering for serving is `numbering`. Adding a
family is its folder and its name in `registry.FAMILY_FOLDERS`
(tests/test_family_newcomer.py counts it).

May import: model, ops and the core.
"""
