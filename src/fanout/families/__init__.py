"""Draft families: one folder per family, one registry line each.

    from fanout.families.registry import FAMILIES, family
    fam = family("dflash2")                   # ConfigError naming the known ones
    draft = fam.build(verifier_dir, **fields)  # its model, from its validated config

A family owns, in its folder: its config (defaults = its reference recipe), its model,
its loss and metrics, what its checkpoint adds to the speculators `config.json`, and
its drafting step (`Family.context`, which `fanout eval` calls). The trainer loop,
consumer stream, optimizer, fused CE, checkpointing and lifecycle are shared; the
checkpoint layout every family shares (markers, layer numbering, format check, the
reader) is `serving`. Adding a family touches its folder and one line of `registry`;
`base.Family` is what a family declares.

May import: model, ops and the core.
"""
