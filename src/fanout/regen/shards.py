"""The output directory of `fanout regenerate`: manifest, shards, the joined file.

    from fanout.regen.shards import OutDir
    OutDir("regen/").check(identity)        # refuses a directory made with other settings
    out = OutDir("regen/").open(identity)   # the same check, then creates or resumes it
    out.done(3)                             # shard 3's summary, or None
    out.write_shard(3, records, summary)    # records: regenerated chats (dicts)
    out.finish(4, totals)                   # shards 0..3 joined, the manifest's totals

Layout:
- `manifest.json`: the run's identity (inputs' fingerprint, verifier fingerprint,
  engine, sampling settings, seed, records per shard) and, once complete, totals;
- `shards/NNNNN.jsonl`: the kept records of input records [N·P, (N+1)·P), in
  input order, each with its `fanout_regen` provenance;
- `shards/NNNNN.json`: that shard's summary (counts, skipped records and why). It is
  written after the data file and is what makes the shard done;
- `regenerated.jsonl`: all shards joined in order, written once every shard is done
  (`fanout prepare --data regen/regenerated.jsonl`, or `fanout produce --data ...`).

Every file goes through the FileSystem's atomic write, so a kill -9 leaves each one
whole or absent. A shard whose data file exists but whose summary does not was cut
short: it is computed again (the same batches, so the same text) and its data file
replaced, so no record is ever written twice. A rerun also removes the temp files of
killed writers. One process per `--out` at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fanout.errors import ConfigError
from fanout.filesystem import FileSystem
from fanout.netfs import temp_writer_gone

MANIFEST = "manifest.json"
JOINED = "regenerated.jsonl"
LAYOUT = "fanout-regen-1"


class OutDir:
    def __init__(self, root: str | Path, fs: FileSystem | None = None) -> None:
        self.root = Path(root)
        self.shards = self.root / "shards"
        self.fs = fs or FileSystem()

    def check(self, identity: dict[str, Any]) -> bool:
        """Whether `open(identity)` would resume (True) or create (False), writing
        nothing; a directory made with another identity, or not empty without a
        manifest, is refused (ConfigError naming --out and the first setting that
        differs). Cheap: `fanout regenerate` calls it before it loads the verifier."""
        old = self.manifest()
        if old is None:
            if self._has_other_files():
                raise ConfigError(
                    f"--out {self.root}: not empty and has no {MANIFEST}; use a new directory"
                )
            return False
        prev = old.get("identity", {})
        if prev != identity:
            keys = sorted(prev.keys() | identity.keys())
            key = next((k for k in keys if prev.get(k) != identity.get(k)), "?")
            raise ConfigError(
                f"--out {self.root}: holds a regeneration made with other settings ({key}: "
                f"{prev.get(key)!r}, now {identity.get(key)!r}); resume with the same "
                "settings or use a new --out"
            )
        return True

    def open(self, identity: dict[str, Any]) -> OutDir:
        """Create the directory and its manifest, or reopen one made with the same
        `identity`; another identity is refused (`check`)."""
        if self.check(identity):
            self._remove_dead_temps()
            return self
        try:
            self.fs.makedirs(self.shards)
        except OSError as e:
            raise ConfigError(f"--out {self.root}: cannot create it: {e.strerror or e}") from None
        self._write_json(
            self.root / MANIFEST, {"layout": LAYOUT, "identity": identity, "complete": False}
        )
        return self

    def _has_other_files(self) -> bool:
        """Anything but what a start killed before its manifest leaves (an empty shards/,
        temp files)?"""
        if not self.root.exists():
            return False
        for p in self.root.iterdir():
            if p == self.shards and p.is_dir() and not any(p.iterdir()):
                continue
            if not (p.name.startswith(".") and p.name.endswith(".tmp")):
                return True
        return False

    def _remove_dead_temps(self) -> None:
        """Temp files (`.NAME.<temp_tag()>.tmp`, FileSystem.write_atomic) of writers
        killed mid-write; a live writer's are left alone (another host's until it is
        old: fanout.netfs.temp_writer_gone)."""
        for d in (self.root, self.shards):
            for p in d.glob(".*.tmp"):
                if temp_writer_gone(p):
                    p.unlink(missing_ok=True)

    def manifest(self) -> dict[str, Any] | None:
        path = self.root / MANIFEST
        if not path.is_file():
            return None
        try:
            m = json.loads(path.read_text())
        except ValueError as e:
            raise ConfigError(
                f"{path}: not valid JSON ({e}); not a regeneration directory?"
            ) from None
        if not isinstance(m, dict) or m.get("layout") != LAYOUT:
            raise ConfigError(f"{path}: not a fanout regeneration manifest (layout {LAYOUT})")
        return m

    def data_path(self, shard: int) -> Path:
        return self.shards / f"{shard:05d}.jsonl"

    def summary_path(self, shard: int) -> Path:
        return self.shards / f"{shard:05d}.json"

    def done(self, shard: int) -> dict[str, Any] | None:
        path = self.summary_path(shard)
        if not path.is_file():
            return None
        out: dict[str, Any] = json.loads(path.read_text())
        return out

    def write_shard(
        self, shard: int, records: list[dict[str, Any]], summary: dict[str, Any]
    ) -> None:
        """The data file, then the summary that marks the shard done (both atomic)."""
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        self.fs.write_atomic(self.data_path(shard), data.encode())
        self._write_json(self.summary_path(shard), summary)

    def finish(self, shards: int, totals: dict[str, Any]) -> Path:
        """Join shards 0..shards-1 into regenerated.jsonl, then mark the manifest complete."""
        joined = self.root / JOINED

        def write(tmp: Any) -> None:
            for s in range(shards):
                self.fs.write(tmp.fd, self.data_path(s).read_bytes())

        self.fs.write_atomic(joined, write)
        m = self.manifest() or {}
        self._write_json(
            self.root / MANIFEST, m | {"complete": True, "shards": shards, "totals": totals}
        )
        return joined

    def _write_json(self, path: Path, obj: dict[str, Any]) -> None:
        self.fs.write_atomic(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())
