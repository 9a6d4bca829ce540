"""A verifier that changes (RL co-training): `fanout produce --follow-verifier`.

    fanout produce --run-dir runs/rl --verifier-name-or-path /ckpt/policy --follow-verifier \
        --follow /logs/rollouts --tokenizer /ckpt/tokenizer ...

`--verifier-name-or-path DIR` is a versioned directory (fanout.checkpoints.versions:
`DIR/current -> versions/vNNNN`, each version a complete HF model directory holding a
`COMMITTED` marker written last: the layout `fanout promote` writes for drafts, which an
RL trainer writes for its policy after each weight sync). The producer starts with the
live version (`current_version`) and, before it claims each window, looks again (a
readlink and a stat): a newly committed version is loaded then, between windows, so a
window is always captured by one version, whole. A version without its marker is never
loaded; one that fails to load is logged and the producer keeps capturing with the
version it has, trying again before the next window. Every replica does the same.

Every window records the version it was captured with, by number (`v0003` is 3): in
its file's metadata (fanout.store.windowfile, `verifier_version`) and in the coordinator
(`windows.verifier_version`), so trainers can skip windows that are too old
(`--max-verifier-lag`) and load the frozen tensors of the version each window was
captured with, and `fanout status` shows the versions live and each consumer's lag.

The capture contract names the versioned directory, not one version's weights (a
restart with a newer version live continues the same stream): its
`verifier_weights_fingerprint` is `follow-verifier:<digest of DIR's absolute path>`.
Every process must see DIR at the same path.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from fanout.checkpoints.versions import (
    VERSIONS,
    Version,
    current_version,
    is_versioned,
    version_number,
)
from fanout.errors import ConfigError
from fanout.hashing import identity_digest

log = logging.getLogger(__name__)

FINGERPRINT_PREFIX = "follow-verifier:"


class FollowVerifierOptions(BaseModel):
    """`fanout produce`'s field for a verifier that changes while it runs."""

    follow_verifier: bool = Field(
        False,
        description="--verifier-name-or-path DIR is a versioned directory (DIR/current -> "
        "versions/vNNNN, each committed by a COMMITTED marker: the layout `fanout promote` "
        "writes): capture with its live version and load a newly committed one between "
        "windows; every window records the version it was captured with",
    )


def pinned(cfg: Any) -> Any:
    """`cfg` with --verifier-name-or-path naming the live version's directory under
    --follow-verifier (every check and load then reads an ordinary HF directory); as it
    is otherwise, or when it already names a version. ConfigError naming the flag for a
    DIR without versions, or without a committed one yet."""
    if not cfg.follow_verifier:
        return cfg
    path = Path(cfg.verifier_name_or_path)
    if version_of(path) is not None:
        return cfg  # pinned before (run() and the Producer both pin)
    if not is_versioned(path):
        raise ConfigError(
            f"--follow-verifier: --verifier-name-or-path {path} has no {VERSIONS}/ (expected "
            f"current -> {VERSIONS}/vNNNN, each version a model directory with a COMMITTED "
            "marker, the layout `fanout promote` writes)"
        )
    v = current_version(path)
    if v is None:
        raise ConfigError(
            f"--follow-verifier: --verifier-name-or-path {path} has no committed version yet "
            f"({VERSIONS}/vNNNN with its COMMITTED marker)"
        )
    if cfg.tp > 1:
        raise ConfigError(
            "--follow-verifier with --tp: every tensor-parallel rank would have to load each "
            "new version in step; run the followed verifier on one device per replica"
        )
    if cfg.regenerate:
        raise ConfigError(
            "--follow-verifier with --regenerate: follow the policy's own rollouts "
            "(--follow or --data) instead of regenerating them"
        )
    return cfg.model_copy(update={"verifier_name_or_path": str(v.path)})


def version_of(path: Path) -> Version | None:
    """The version `path` is (`DIR/versions/v0003`), None for any other directory."""
    n = version_number(path.name)
    if n is None or path.parent.name != VERSIONS:
        return None
    return Version(path.name, n, path)


class VerifierFollower:
    """Which version of a versioned directory the producer captures with, and when a
    newer one is committed. Built from a pinned config (`pinned`)."""

    def __init__(self, version: Version) -> None:
        self.root = version.path.parent.parent
        self.version = version
        self.swaps = 0
        self._failed: int | None = None  # a version that failed to load (said once)

    @classmethod
    def of(cls, cfg: Any) -> VerifierFollower | None:
        """The follower of a pinned --follow-verifier config, None without the flag."""
        if not cfg.follow_verifier:
            return None
        v = version_of(Path(cfg.verifier_name_or_path))
        assert v is not None, "pinned() first"
        return cls(v)

    def fingerprint(self) -> str:
        """The contract's `verifier_weights_fingerprint`: the versioned directory, not
        one version's weights (see the module docstring)."""
        digest = identity_digest({"follow_verifier": str(self.root.resolve())})[:16]
        return FINGERPRINT_PREFIX + digest

    def newer(self) -> Version | None:
        """The live version when it is not the one loaded (a rollback of `current`
        included), else None."""
        v = current_version(self.root)
        return None if v is None or v.number == self.version.number else v

    def contract_fields(self, verifier: Any) -> dict[str, Any]:
        """`verifier`'s capture-contract fields, its weights named by the directory."""
        fields = dict(verifier.contract_fields())
        fields["verifier_weights_fingerprint"] = self.fingerprint()
        return fields

    def swap(self, load: Any, contract: Any) -> Any:
        """Between windows: load the live version with `load(path)` when it changed and
        return the new verifier (None: keep the one loaded). A version that would change
        what windows mean against `contract` (another shape, layer set or dtype) stops
        the producer (ConfigError); one that fails to load is logged once and kept off,
        and a later one is tried."""
        v = self.newer()
        if v is None or v.number == self._failed:
            return None
        t0 = time.monotonic()
        try:
            new = load(v.path)
        except (OSError, ValueError, RuntimeError, ConfigError) as e:
            self._failed = v.number
            log.error(
                "verifier version %s (%s) failed to load: %s; capturing with %s until a "
                "newer one is committed", v.name, v.path, e, self.version.name,
            )  # fmt: skip
            return None
        diff = {
            k: (getattr(contract, k), got)
            for k, got in self.contract_fields(new).items()
            if k != "verifier_config_hash" and getattr(contract, k) != got
        }
        if diff:
            raise ConfigError(
                f"--follow-verifier: version {v.name} ({v.path}) would change the capture "
                f"contract ({diff}, the run's value first): a new version may change the "
                "weights only"
            )
        log.info(
            "verifier version %s -> %s loaded in %.1f s (%s): the next window is captured "
            "with it", self.version.name, v.name, time.monotonic() - t0, v.path,
        )  # fmt: skip
        self.version, self._failed = v, None
        self.swaps += 1
        return new
