"""A versioned directory: `current` -> `versions/vNNNN`, each version committed by a marker.

    from fanout.checkpoints.versions import current_version, is_versioned
    v = current_version("/srv/policy")     # Version(name="v0003", number=3, path=...), or None
    is_versioned("/srv/policy")            # True: it has versions/ (or current)

The one layout both sides of fanout's loop share:
- `fanout promote --served DIR` writes it for drafts (fanout.decode.promote.Served);
- an RL trainer writes it for its policy, and `fanout produce --follow-verifier
  --verifier-name-or-path DIR` (and every trainer given that DIR) reads it.

    DIR/current -> versions/v0003     # one rename flips it (FileSystem.point)
    DIR/versions/v0001 … v0003        # each a complete directory (an HF model, a draft
                                      # checkpoint) holding COMMITTED, written last

A version is read only once it is committed (its `COMMITTED` marker exists): one without
it is being written (or was left half-written by a killed writer) and is never loaded.
`current_version` is the one rule for which version is live: the version `current`
names when it is committed; while `current` names one that is not (a writer that flips
the link before the marker), the newest committed version below it; without a
`current` link, the newest committed version. Version numbers are the digits of the
name (`v0003` is 3) and only grow, so "N versions behind" is a subtraction.

No torch: `fanout status` and the producer's between-window check read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from fanout.checkpoints.layout import MARKER

# a versioned directory's layout (fanout.decode.promote writes it for drafts)
CURRENT, VERSIONS = "current", "versions"
_VERSION = re.compile(r"^v(\d{4,})$")


@dataclass(frozen=True, slots=True)
class Version:
    """One committed version of a versioned directory."""

    name: str  # "v0003"
    number: int  # 3
    path: Path  # DIR/versions/v0003 (not through the `current` link)


def version_name(number: int) -> str:
    """The directory name of version `number`: `v0003`."""
    return f"v{int(number):04d}"


def version_number(name: str) -> int | None:
    """The number of a version directory's name (`v0003` -> 3), None for another name."""
    m = _VERSION.match(name)
    return int(m.group(1)) if m else None


def is_versioned(root: str | Path) -> bool:
    """Whether `root` has the versioned layout (a `versions/` dir or a `current` link)."""
    r = Path(root)
    return (r / VERSIONS).is_dir() or (r / CURRENT).is_symlink()


def committed_versions(root: str | Path) -> list[Version]:
    """The committed versions under `root`, oldest first (those without the marker are
    being written and are left out)."""
    d = Path(root) / VERSIONS
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        n = version_number(p.name)
        if n is not None and (p / MARKER).is_file():
            found.append(Version(p.name, n, p))
    return sorted(found, key=lambda v: v.number)


def current_version(root: str | Path) -> Version | None:
    """The live version of `root` (see the module docstring), None while it has no
    committed version."""
    r = Path(root)
    link = r / CURRENT
    done = committed_versions(r)
    if link.is_symlink():
        n = version_number(link.resolve().name)
        if n is None:
            return None  # `current` names something that is not a version: nothing live
        below = [v for v in done if v.number <= n]
        return below[-1] if below else None
    return done[-1] if done else None


def version_dir(root: str | Path, number: int) -> Path | None:
    """Committed version `number`'s directory under `root`, None when it is not there
    (never committed, or pruned since)."""
    p = Path(root) / VERSIONS / version_name(number)
    return p if (p / MARKER).is_file() else None
