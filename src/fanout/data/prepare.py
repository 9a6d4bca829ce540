"""`fanout prepare`: chat data → packed, loss-masked rows (cached), or streamed online.

    fanout prepare --data ../shared/data/chat/mt-bench-101/mtbench101.jsonl \\
        --tokenizer ../shared/data/tokenizers/qwen3 --seq-len 4096 --out /tmp/prepared

    from fanout.data.prepare import PrepareConfig, prepare, open_packed, iter_packed_rows, prewarm
    cfg = PrepareConfig(data=["chat.jsonl"], tokenizer="tok/", seq_len=4096)
    ds = prepare(cfg)                      # or loads from the fingerprinted cache
    ds.rows(np.arange(4))["input_ids"]     # [4, 4096] int32
    for batch in iter_packed_rows(cfg): …  # online: rows while workers still tokenize

Pipeline: files are read in chunks (JSONL lines stay raw bytes) → the shared warm
worker pool parses, converts, renders the chat template, tokenizes and masks each
chunk (fanout.data.workers) → results come back in input order → optional seeded
shuffle buffer → best-fit packer (fanout.data.packing) → safetensors shards in the
cache (fanout.data.cache). Nothing here imports torch or transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from itertools import chain, repeat
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from fanout.data.cache import MANIFEST, PackedDataset, ShardWriter, fingerprint
from fanout.data.chat import ChatFormat, ReadOptions, detect_format, iter_raw_chunks
from fanout.data.masks import RULES_VERSION, VERIFY_ROWS, MaskPathName, plan_path
from fanout.data.packing import Doc, OverLength, Packer, shuffled
from fanout.data.template import (
    ChatSpec,
    default_cache_root,
    load_chat_spec,
    tokenizer_fingerprint,
)
from fanout.data.workers import ChunkResult, ChunkTask, WorkerPool, encode_chunk, shared_pool
from fanout.errors import BadRow, ConfigError
from fanout.filesystem import FileSystem
from fanout.flags import CommandFlags, field_flag, flag_options
from fanout.netfs import host_build_lock, temp_tag

__all__ = [
    "DataOptions",
    "PackedDataset",
    "PrepareConfig",
    "check_prepared",
    "is_prepared_dir",
    "iter_packed_rows",
    "open_packed",
    "prepare",
    "prewarm",
]

log = logging.getLogger(__name__)


def existing_files(paths: list[str]) -> list[str]:
    """`paths` unchanged if every one is a file; else the error a `data` field raises."""
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise ValueError(f"no such file(s): {missing}")
    return paths


class DataOptions(ChatFormat, ReadOptions):
    """Data-stage options every command that prepares rows shares (`fanout prepare`,
    `fanout produce`), on top of the chat format and how bad rows are read. Declared once here; the commands'
    configs inherit them, so each is one flag and one config-file key everywhere."""

    data: list[str] = Field(
        description="input files: JSON array, JSONL or Parquet (fanout produce: or one "
        "directory that fanout prepare --out wrote, used as it is)",
        min_length=1,
    )
    chat_template: str | None = Field(
        None,
        description="chat template file (.jinja, or .json holding chat_template) to use "
        "instead of the tokenizer's",
    )
    mask_path: MaskPathName = Field(
        "auto",
        description="how the loss mask is computed: auto = the fastest path the template "
        "allows, checked against the prefix rule; or force one (prefix-rule: the rule "
        "itself, any template); part of the cache key",
    )
    workers: int | None = Field(
        None, ge=0, description="worker processes; None/0 = all usable cores (FANOUT_WORKERS)"
    )
    cache_dir: str | None = Field(
        None,
        description="cache root: prepared rows and tokenizer builds (default: $FANOUT_CACHE, "
        "else ~/.cache/fanout; fanout produce looks there first, then prepares into "
        "RUN_DIR/cache)",
    )
    over_length: OverLength = Field(
        "split", description="conversations longer than seq_len: split | drop | error"
    )
    lookahead: int = Field(64, ge=1, description="open rows the best-fit packer keeps")
    chunk_rows: int = Field(512, ge=1, description="rows per worker task")
    rows_per_shard: int = Field(1024, ge=1, description="packed rows per cache shard")

    def chat_format(self) -> ChatFormat:
        return ChatFormat(**{k: getattr(self, k) for k in ChatFormat.model_fields})

    def data_options(self) -> dict[str, Any]:
        """This config's DataOptions fields, by name (to build a PrepareConfig from)."""
        return {k: getattr(self, k) for k in DataOptions.model_fields}


# The DataOptions fields that change the packed rows (cache fingerprint inputs, with the
# template and mask path, which enter through the tokenizer spec). A prepared directory
# given to `fanout produce --data` is refused if one of these was given other than so.
ROW_OPTIONS = (*ChatFormat.model_fields, "on_bad_row", "over_length", "lookahead")


class PrepareConfig(DataOptions):
    """Every option of the data stage; each field is one `fanout prepare` flag.

    The chat-format and shared data fields come from ChatFormat and DataOptions;
    these are prepare's own. `fanout produce` declares its own `tokenizer` (optional:
    the verifier's), `seq_len` (part of its contract) and `seed` (its stream seed), and
    has no row shuffle of prepare's (it permutes rows per epoch itself)."""

    tokenizer: str = Field(description="local Hugging Face tokenizer directory")
    seq_len: int = Field(4096, ge=2, description="tokens per packed row (T)")
    no_cache: bool = Field(
        False, description="neither read nor write the prepared-rows cache (needs --out)"
    )
    out: str | None = Field(None, description="output directory (default: the cache entry)")
    shuffle_buffer: int = Field(0, ge=0, description="seeded shuffle buffer (docs); 0 = off")
    seed: int = Field(0, description="shuffle seed")
    epoch: int = Field(0, ge=0, description="epoch (changes the shuffled order)")
    as_json: bool = Field(
        False,
        description="print the summary as one JSON object on stdout",
        json_schema_extra=flag_options(flag="--json"),
    )

    # Only here, not in DataOptions: a ProducerConfig names files that need not exist
    # yet when it is built (fanout.produce.config.check_inputs checks them at start).
    @field_validator("data")
    @classmethod
    def _files_exist(cls, v: list[str]) -> list[str]:
        return existing_files(v)

    @field_validator("chat_template")
    @classmethod
    def _template_exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"no such file: {v}")
        return v

    def cache_root(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_root()

    def output_options(self) -> dict[str, Any]:
        """Every option that changes the packed rows (the cache fingerprint's inputs)."""
        keep = [*ROW_OPTIONS, "seq_len", "shuffle_buffer", "seed", "epoch"]
        return {k: getattr(self, k) for k in keep}


def open_packed(out_dir: str | Path) -> PackedDataset:
    """Reopen a prepared dataset directory (an `--out` dir or a cache entry)."""
    return PackedDataset(out_dir)


def is_prepared_dir(path: str | Path) -> bool:
    """A directory `fanout prepare --out` wrote (or a cache entry): it has a manifest.json."""
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def _shown(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def _same_template(recorded: str | None, given: str | None) -> bool:
    if recorded is None or given is None:
        return recorded == given
    a, b = Path(recorded), Path(given)
    if a.is_file() and b.is_file():  # the same text: the same template, wherever it lies
        return a.read_bytes() == b.read_bytes()
    return a.resolve() == b.resolve()


def check_prepared(
    ds: PackedDataset,
    label: str,
    *,
    seq_len: int,
    tokenizer: str | None,
    tokenizer_flag: str = "--tokenizer",
    given: dict[str, Any],
) -> None:
    """Refuse rows prepared with other settings than a consumer of them asks for: ConfigError
    naming `label` (e.g. `--data DIR`) and the first field that differs.

    `seq_len`: the T the caller needs (its `--seq-len`). `tokenizer`: the caller's tokenizer
    directory, None when it has none to compare (its rows' tokenizer is then the one they
    were prepared with); `tokenizer_flag` names where it came from. `given`: the row options (ROW_OPTIONS, `chat_template`,
    `mask_path`) the caller was given explicitly, by field name, as JSON values; each must
    equal what the rows were prepared with, since the rows are used as they are."""
    if ds.seq_len != seq_len:
        raise ConfigError(
            f"{label}: its rows were prepared with --seq-len {ds.seq_len}, this command's "
            f"--seq-len is {seq_len}: pass --seq-len {ds.seq_len}, or prepare again with "
            f"--seq-len {seq_len}"
        )
    recorded: dict[str, Any] = ds.manifest.get("config", {})
    if tokenizer is not None:
        ours = tokenizer_fingerprint(tokenizer)
        if ours != ds.tokenizer_fingerprint:
            raise ConfigError(
                f"{label}: its rows were prepared with another tokenizer "
                f"({recorded.get('tokenizer', '?')}, fingerprint {ds.tokenizer_fingerprint}) "
                f"than this command's ({tokenizer_flag} {tokenizer}, fingerprint {ours}): "
                f"prepare again with --tokenizer {tokenizer}"
            )
    for name, value in given.items():
        if name not in recorded:
            continue  # a manifest from before the field existed: nothing to compare
        theirs = recorded[name]
        same = _same_template(theirs, value) if name == "chat_template" else theirs == value
        if not same:
            flag = field_flag(name, DataOptions.model_fields[name])
            raise ConfigError(
                f"{label}: its rows were prepared with {flag} {_shown(theirs)}, this command "
                f"was given {flag} {_shown(value)}: drop {flag} (the rows are used as they "
                f"are), or prepare again with it"
            )


def prewarm(cfg: PrepareConfig) -> tuple[ChatSpec, WorkerPool]:
    """Load the tokenizer spec and start the workers in the background; returns at once."""
    spec = load_chat_spec(cfg.tokenizer, cfg.cache_root(), cfg.chat_template, cfg.mask_path)
    pool = shared_pool(cfg.workers)
    pool.prewarm(spec)
    return spec, pool


def _chunk_sizes(chunk_rows: int) -> Iterator[int]:
    # Small first chunks so the first rows arrive fast; full-size after that.
    return chain((s for s in (32, 128) if s < chunk_rows), repeat(chunk_rows))


def _tasks(cfg: PrepareConfig, spec: ChatSpec, formats: dict[str, str]) -> Iterator[ChunkTask]:
    skip = cfg.on_bad_row == "skip"
    for path in cfg.data:
        fmt: ChatFormat | None = None
        for (file, first), items, raw, nbytes in iter_raw_chunks(
            path, _chunk_sizes(cfg.chunk_rows)
        ):
            verify = 0
            if fmt is None:  # a file's first chunk: its first rows check the mask path
                fmt = detect_format(_head(file, items, raw), cfg.chat_format())
                formats[file] = f"{fmt.format} (turns in '{fmt.resolved_messages_field()}')"
                verify = VERIFY_ROWS
            yield ChunkTask(spec, fmt, file, first, items, raw, skip, nbytes, verify)


def _head(file: str, items: list[Any], raw: bool) -> list[Any]:
    """The first few parsed records, for format detection (bad JSON is skipped here)."""
    if not raw:
        return items[:8]
    out = []
    for _, line in items[:8]:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class _Run:
    """One pass: chunks → docs → packer; keeps the counters for the summary."""

    def __init__(
        self, cfg: PrepareConfig, spec: ChatSpec, pool: WorkerPool, track_rows: bool = False
    ) -> None:
        self.cfg, self.spec, self.pool = cfg, spec, pool
        self.formats: dict[str, str] = {}
        self.skipped: dict[str, int] = {}
        self.rows_in = 0
        self.mask_paths: dict[str, int] = {}  # path -> chunks; plus rows aligned / verified
        self.mask_aligned = self.mask_verified = 0
        self.packer = Packer(cfg.seq_len, cfg.lookahead, cfg.over_length, spec.pad_token_id,
                             track_rows=track_rows)  # fmt: skip
        self.t0 = time.perf_counter()
        self.bar: Any = None
        if cfg.progress:
            from tqdm import tqdm

            total = sum(Path(p).stat().st_size for p in cfg.data)
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr)

    def _results(self) -> Iterator[ChunkResult]:
        tasks = _tasks(self.cfg, self.spec, self.formats)
        for res in self.pool.map_ordered(encode_chunk, tasks):
            if res.error is not None:
                raise BadRow(*res.error)
            self.rows_in += res.rows_in
            self.mask_paths[res.mask_path] = self.mask_paths.get(res.mask_path, 0) + 1
            self.mask_aligned += res.aligned
            self.mask_verified += res.verified
            for k, v in res.skipped.items():
                self.skipped[k] = self.skipped.get(k, 0) + v
            if self.bar is not None:
                dt = max(1e-9, time.perf_counter() - self.t0)
                self.bar.set_postfix_str(
                    f"{self.rows_in / dt:,.0f} rows/s {self.packer.tokens / dt:,.0f} tok/s"
                )
                self.bar.update(res.nbytes)
            yield res

    def _docs(self) -> Iterator[Doc]:
        for res in self._results():
            offs = np.concatenate([[0], np.cumsum(res.lengths)])  # [D+1]
            for d in range(res.lengths.shape[0]):
                a, b = offs[d], offs[d + 1]
                yield Doc(res.ids[a:b], res.mask[a:b], (res.file, int(res.lines[d])))

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        docs = shuffled(self._docs(), self.cfg.shuffle_buffer, self.cfg.seed, self.cfg.epoch)
        try:
            for doc in docs:
                out = self.packer.add(doc)
                if out is not None:
                    yield out
            out = self.packer.flush()
            if out is not None:
                yield out
        finally:
            if self.bar is not None:
                self.bar.close()

    def summary(self) -> dict[str, Any]:
        secs = time.perf_counter() - self.t0
        rep = self.packer.report()
        return {
            **rep,
            "input_rows": self.rows_in,
            "skipped_bad_rows": sum(self.skipped.values()),
            "skipped_by_reason": dict(sorted(self.skipped.items())),
            "formats": self.formats,
            "seconds": round(secs, 3),
            "tokens_per_s": round(float(rep["tokens"]) / secs, 1) if secs > 0 else 0.0,
            "workers": self.pool.workers,
            "mask_path": ",".join(sorted(self.mask_paths)) or plan_path(self.spec),
            "mask_verified_rows": self.mask_verified,
            "mask_aligned_rows": self.mask_aligned,
            "chat_template": self.spec.template_source,
        }


def iter_packed_rows(cfg: PrepareConfig) -> Iterator[dict[str, np.ndarray]]:
    """Online mode: yield dicts of [n, T] arrays as rows close; no cache, no full pass."""
    spec, pool = prewarm(cfg)
    yield from _Run(cfg, spec, pool).batches()


def _materialize(entry: Path, out: Path) -> None:
    """Make `out` a copy of a cache entry (hard links when possible), atomically."""
    if out.resolve() == entry.resolve():
        return
    if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: exists and is not a prepared dataset; refusing to replace")
    fs = FileSystem()
    tmp = out.with_name(f"{out.name}.tmp{temp_tag()}")
    fs.makedirs(tmp)
    try:
        for f in entry.iterdir():
            try:
                fs.link(f, tmp / f.name)
            except OSError:  # other filesystem
                shutil.copy2(f, tmp / f.name)
        fs.commit_dir(tmp, out)  # fsyncs the copies; an older `out` is swapped out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _rows_fingerprint(cfg: PrepareConfig, spec: ChatSpec, track_rows: bool = False) -> str:
    """The cache key of `cfg`'s rows: inputs, tokenizer, template, mask rules, row options
    (and `track_rows`: an entry without the rows' sources in its summary is another)."""
    return fingerprint(
        list(cfg.data),
        {
            "tokenizer": spec.fingerprint,
            "template": spec.template_fingerprint(),
            "mask_path": plan_path(spec),
            "mask_rules": RULES_VERSION,
            **cfg.output_options(),
            **({"track_rows": True} if track_rows else {}),
        },
    )


def _has_tokenizer_build(root: Path, tokenizer_fp: str) -> bool:
    # prepare builds the tokenizer spec in the root it writes rows to: a root without it
    # holds no rows of this tokenizer either, and looking there must build nothing
    return (root / "tokenizers" / tokenizer_fp / "chat.json").is_file()


def prepare(
    cfg: PrepareConfig,
    look_in: Sequence[Path] = (),
    *,
    announce: bool = False,
    track_rows: bool = False,
) -> PackedDataset:
    """Run the data stage (or load it from the cache) and return the packed dataset.

    `look_in`: other cache roots to find the rows in (fanout produce: the one `fanout
    prepare` writes to); rows are only ever written under `cfg.cache_root()`.
    `announce`: log which cache entry is used, or where the rows are being prepared.
    `track_rows`: the summary also names each row's source lines and real tokens
    (`row_lines`, `row_tokens`: fanout.produce.follow carries short rows' records)."""
    root = cfg.cache_root()
    roots = [root, *(r for r in look_in if r != root)]
    # no workers on a cache hit, and no tokenizer build where one is already cached
    spec_root = root
    if len(roots) > 1:
        tok_fp = tokenizer_fingerprint(cfg.tokenizer)
        spec_root = next((r for r in roots if _has_tokenizer_build(r, tok_fp)), root)
    spec = load_chat_spec(cfg.tokenizer, spec_root, cfg.chat_template, cfg.mask_path)
    fp = _rows_fingerprint(cfg, spec, track_rows)
    entry = root / "prepared" / fp
    found = [r / "prepared" / fp for r in roots if (r / "prepared" / fp / MANIFEST).is_file()]
    if not cfg.no_cache and found:
        return _use_entry(cfg, found[0], fp, announce)
    if cfg.no_cache and not cfg.out:
        raise ConfigError("--no-cache needs --out (where else would the rows go?)")
    if cfg.no_cache:  # straight into --out: nothing shared to race for
        return _build(cfg, root, spec_root, spec, fp, Path(str(cfg.out)), announce, track_rows)
    with _building(entry):
        if (entry / MANIFEST).is_file():  # another process built it while we waited
            return _use_entry(cfg, entry, fp, announce)
        return _build(cfg, root, spec_root, spec, fp, entry, announce, track_rows)


def _use_entry(cfg: PrepareConfig, hit: Path, fp: str, announce: bool) -> PackedDataset:
    """The rows of a cache entry: as they are, or copied to --out."""
    if announce:
        log.info("using prepared rows from %s (fingerprint %s)", hit, fp)
    if cfg.out:
        _materialize(hit, Path(cfg.out))
        return PackedDataset(cfg.out)
    return PackedDataset(hit)


@contextlib.contextmanager
def _building(entry: Path) -> Iterator[None]:
    """One process of this host at a time builds a cache entry; another that wants the
    same rows (M producer replicas started together on one host) waits, then uses them,
    instead of preparing them again on the same cores. Best effort
    (`fanout.netfs.host_build_lock`: never a lock file on the shared cache): across
    hosts, or where no lock can be taken, each builds into its own temp and the first
    complete entry wins (`ShardWriter.commit`). A forked worker's inherited copy of the
    lock's descriptor lives at most a second longer than its holder (workers exit with
    their parent, fanout.data.workers)."""

    def waiting() -> None:
        log.warning("another process is preparing the same rows into %s: waiting for it", entry)

    with host_build_lock(entry, on_wait=waiting):
        yield


def _build(
    cfg: PrepareConfig,
    root: Path,
    spec_root: Path,
    spec: ChatSpec,
    fp: str,
    target: Path,
    announce: bool,
    track_rows: bool = False,
) -> PackedDataset:
    """Prepare the rows into `target` (the cache entry, or --out under --no-cache)."""
    if target.exists() and not (target / MANIFEST).is_file() and any(target.iterdir()):
        raise ConfigError(f"--out {target}: exists and is not a prepared dataset")
    if spec_root != root:  # the workers read this root's tokenizer build, not another's
        spec = load_chat_spec(cfg.tokenizer, root, cfg.chat_template, cfg.mask_path)
    if announce:
        log.info("preparing %s into %s (fingerprint %s)", ", ".join(cfg.data), target, fp)
    pool = shared_pool(cfg.workers)
    pool.prewarm(spec)
    run = _Run(cfg, spec, pool, track_rows)
    # --no-cache writes straight into --out, replacing what an earlier prepare left there
    writer = ShardWriter(target, cfg.seq_len, cfg.rows_per_shard, replace=cfg.no_cache)
    try:
        for batch in run.batches():
            writer.write(batch)
        summary = run.summary()
        built = writer.commit(
            {
                "fingerprint": fp,
                "tokenizer_fingerprint": spec.fingerprint,
                "template_fingerprint": spec.template_fingerprint(),
                "pad_token_id": spec.pad_token_id,
                "summary": summary,
                "config": cfg.model_dump(mode="json"),
            }
        )
    except BaseException:
        writer.abort()
        raise
    if cfg.out and not cfg.no_cache:
        _materialize(built, Path(cfg.out))
        return PackedDataset(cfg.out)
    return PackedDataset(built)


# --------------------------------------------------------------------------- CLI


_FLAGS = CommandFlags(PrepareConfig)  # `fanout prepare`'s flags: PrepareConfig's fields
add_arguments, config_from_args = _FLAGS.add_arguments, _FLAGS.config_from_args


def format_summary(ds: PackedDataset) -> str:
    s = ds.summary
    lines = [
        ("dataset", str(ds.dir)),
        ("fingerprint", ds.fingerprint),
        ("size on disk", f"{ds.manifest.get('bytes', 0) / 1e6:,.1f} MB"),
        ("input rows", f"{s['input_rows']:,}"),
        ("documents", f"{s['documents']:,}"),
        ("packed rows", f"{s['rows']:,} × {ds.seq_len}"),
        ("tokens", f"{s['tokens']:,}"),
        ("masked tokens", f"{s['masked_tokens']:,}"),
        ("fill", f"{s['fill']:.2%}"),
        ("over-length split/dropped", f"{s['split_over_length']}/{s['dropped_over_length']}"),
        ("skipped bad rows", f"{s['skipped_bad_rows']}"),
    ]
    if "mask_path" in s:
        lines.append(
            (
                "loss mask",
                f"{s['mask_path']} (checked against the prefix rule on {s['mask_verified_rows']} "
                f"rows; {s['mask_aligned_rows']} rows aligned)",
            )
        )
    lines += [(f"  skipped: {k}", str(v)) for k, v in s["skipped_by_reason"].items()]
    lines += [(f"format {Path(f).name}", v) for f, v in s["formats"].items()]
    lines += [
        ("workers", str(s["workers"])),
        ("seconds", f"{s['seconds']:.2f}"),
        ("tokens/s", f"{s['tokens_per_s']:,.0f}"),
    ]
    w = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in lines)


def run(args: argparse.Namespace, name: str = "prepare") -> int:
    cfg = config_from_args(args)
    t0 = time.perf_counter()
    ds = prepare(cfg)
    if cfg.as_json:
        print(json.dumps({"dir": str(ds.dir), "fingerprint": ds.fingerprint, **ds.summary}))
    else:
        print(format_summary(ds))
        root = cfg.cache_root() / "prepared"
        if not cfg.no_cache:
            print(f"cache: {root} ({_dir_bytes(root) / 1e6:,.1f} MB)")
        print(f"done in {time.perf_counter() - t0:.2f} s")
    return 0


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.is_dir() else 0
