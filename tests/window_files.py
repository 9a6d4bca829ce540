"""What tests (and benchmarks) ask of a run's window files that fanout itself never
needs: which files are there, and where one tensor's bytes lie in a file.

    from window_files import tensor_byte_range, window_names
    names = window_names(store)                        # sorted by (window, generation)
    lo, hi = tensor_byte_range(store.path(names[0]), "hidden_states.3")

The byte range is read from the safetensors header itself, not through
fanout.store.windowfile's reader, so a test of that reader does not lean on it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fanout.store.store import Store
from fanout.store.windowfile import parse_window_name


def window_names(store: Store) -> list[str]:
    """The final-named window files in the run dir now, sorted by (window, generation)."""
    names = [e.name for e in os.scandir(store.run_dir.windows) if parse_window_name(e.name)]
    return sorted(names, key=lambda n: parse_window_name(n) or (0, 0))


def tensor_byte_range(path: Path, name: str) -> tuple[int, int]:
    """[start, end) file offsets of tensor `name`'s bytes in the safetensors file `path`:
    an 8-byte little-endian header length, the JSON header, then the data, which each
    tensor's `data_offsets` index."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        start, end = json.loads(f.read(n))[name]["data_offsets"]
    return 8 + n + start, 8 + n + end
