"""The two hashes fanout writes, each for one job: content and identity.

    from fanout.hashing import CHECKSUM_ALGO, hasher, hexdigest, labelled, identity_digest
    h = hasher(); h.update(b"bytes"); labelled(h)   # 'xxh3_128:<32 hex>' (window checksums)
    hexdigest(b"bytes")                             # '<32 hex>' (cache keys, fingerprints)
    identity_digest({"a": 1})                       # '<64 hex>' sha256 of canonical JSON

Content (window checksums and every fingerprint of data, tokenizer, chat template,
verifier weights) is xxh3-128; identities that people and other tools read (the stream
id, the verifier's config hash, the demo assets' key) are sha256 of canonical JSON.

xxh3-128 (xxhash, seed 0): fast enough to hash a window while it is written (GB/s,
releases the GIL), and 128 bits keep accidental collisions out of reach. Changing it
changes every window checksum and fingerprint, so every existing window, data cache
and contract: `CHECKSUM_ALGO` is written into each window checksum, and a reader
refuses a label it does not know (fanout.store.windowfile). Stdlib + xxhash only, so
every layer may use it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

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


def identity_digest(obj: Any) -> str:
    """sha256 (64 hex) of `obj` as canonical JSON (sorted keys, no spaces).

    Why sha256 and not xxh3 here: these digests name things outside one run's bytes
    (a stream id in contract.json and the coordinator, a verifier's config in a
    checkpoint), anyone can recompute them with `sha256sum`, and they must not change
    when the content hash does. Callers shorten them where a name needs to be short.
    """
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
