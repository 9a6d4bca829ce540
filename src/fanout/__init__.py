"""fanout: one verifier pass, fanned out to N DFlash draft trainers.

Start with `./dev.sh demo` (README); docs/architecture.md is the map. The folders
follow the data path, and a module imports only from layers below its own
(checked by `lint-imports`, contract in pyproject.toml):

    chaos                      kill -9 driver over the real CLI
    cli                        `fanout SUBCOMMAND`: maps names to modules
    bench                      benchmark harness, reports, telemetry, demo
    produce | train            the producer role | the trainer role (siblings)
    coord                      the coordinator: leases, cursors, eviction, liveness
    store                      window files and the run directory
    data                       chat data → packed, loss-masked token rows
    model                      the verifier (HF) and the DFlash draft
    ops                        fused kernels: linear CE/KL, AdamW, argmax, fp8
    contract, flags, filesystem, errors   the core every layer may use

Importing `fanout` is cheap (no torch).
"""

__version__ = "0.1.0"


def package_version(name: str) -> str | None:
    """An installed distribution's version (package metadata), None when it is not
    installed: the one lookup provenance (fanout.regen) and reports (fanout.bench) use."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
