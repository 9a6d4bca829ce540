"""The one content hash: window checksums and every fingerprint (data, tokenizer, chat
template, verifier weights) go through here.

    from fanout.hashing import CHECKSUM_ALGO, hasher, hexdigest, labelled
    h = hasher(); h.update(b"bytes"); labelled(h)   # 'xxh3_128:<32 hex>' (window checksums)
    hexdigest(b"bytes")                             # '<32 hex>' (cache keys, fingerprints)

xxh3-128 (xxhash, seed 0): fast enough to hash a window while it is written (GB/s,
releases the GIL), and 128 bits keep accidental collisions out of reach. Changing it
changes every window checksum and fingerprint, so every existing window, data cache
and contract: `CHECKSUM_ALGO` is written into each window checksum, and a reader
refuses a label it does not know (fanout.store.windowfile). Stdlib + xxhash only, so
every layer may use it.
"""

from __future__ import annotations

import xxhash

CHECKSUM_ALGO = "xxh3_128"
HEX_DIGITS = 32  # hex digits of one digest


def hasher(data: bytes | memoryview = b"") -> xxhash.xxh3_128:
    """An incremental hasher (`update`, `hexdigest`), fed `data` first."""
    return xxhash.xxh3_128(data)


def hexdigest(data: bytes | memoryview) -> str:
    """The digest of `data` as hex, unlabelled."""
    return xxhash.xxh3_128_hexdigest(data)


def labelled(h: xxhash.xxh3_128) -> str:
    """`<algo>:<hex>`, how window checksums and the weights fingerprint are written."""
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"
