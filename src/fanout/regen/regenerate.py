"""`fanout regenerate`: the same conversations, with the verifier's own answers.

    fanout regenerate --verifier-name-or-path VERIFIER_DIR --tokenizer TOKENIZER_DIR \\
        --data ../shared/data/chat/mt-bench-101/mtbench101.jsonl --out regen/ \\
        --temperature 0.8 --top-p 0.95 --max-new-tokens 256 --turns last

    from fanout.regen.regenerate import RegenerateConfig, regenerate
    summary = regenerate(RegenerateConfig(verifier_name_or_path=..., data=[...], out="regen/"))

Input: any chat data `fanout prepare` reads (the ChatFormat flags). Output
(`--out`, fanout.regen.shards): `regenerated.jsonl`, one record per kept input
record, in input order, in the `openai` shape `{"messages", "tools"?, "fanout_regen"}`:
system, user and tool turns as they were, the assistant turns chosen by `--turns`
replaced by the verifier's answers, and `fanout_regen` the provenance (source
file:line, record index, verifier fingerprint, engine, sampling settings, seed, the
software that wrote it (fanout version and commit, torch and transformers versions),
and per answer its message index, seed, finish reason, prompt and answer tokens).

Which turns: `last` regenerates the last assistant turn given the original history;
`all` regenerates every assistant turn in order, each given the regenerated history
before it. Assistant turns that make tool calls are kept as they are (the tool
results after them answer those calls); a record whose chosen turn is a tool call is
skipped. A record is skipped, with its reason, counted in the summary and listed in
its shard's summary, when its answer is empty, fails `--answer-attempts` times, or (by
default) is cut at `--max-new-tokens` (`--keep-truncated` keeps those, counted).

Crash-safe and resumable: records are done in shards of `--records-per-shard`
input records; a kill -9 and a rerun with the same flags give every record once and
the same text (fanout.regen.shards, fanout.regen.engine.record_seed).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from fanout.data.chat import (
    ChatFormat,
    Conversation,
    ReadOptions,
    detect_format,
    iter_raw_chunks,
    to_conversation,
)
from fanout.data.prepare import PrepareConfig, existing_files
from fanout.data.template import VerifierTokenizer
from fanout.errors import BadRow, ConfigError
from fanout.flags import add_model_flags, draws_progress, limit_flag, model_from_args
from fanout.hashing import hasher, labelled
from fanout.model.verifier import DTypeName
from fanout.regen.engine import (
    Answer,
    Engine,
    RegenOptions,
    Request,
    assistant_message,
    record_seed,
)
from fanout.regen.shards import OutDir

log = logging.getLogger(__name__)


class RegenerateConfig(ChatFormat, ReadOptions, RegenOptions):
    """Every `fanout regenerate` flag: the chat format and bad-row handling (ChatFormat,
    ReadOptions, as `fanout prepare` reads them), how answers are generated
    (RegenOptions), and these."""

    # Not DataOptions': chat files only, never a prepared dir (regenerate does not pack).
    data: list[str] = Field(description="input files: JSON array, JSONL or Parquet", min_length=1)
    out: str = Field(description="output directory (resumable: rerun with the same flags)")
    # Not ProducerConfig's: optional, as the openai engine needs no local verifier.
    verifier_name_or_path: str | None = Field(
        None,
        description="local HF verifier directory (hf engine: required; openai engine: "
        "recorded as the served model's fingerprint when given)",
    )
    # Not ProducerConfig's field (no component both commands inherit holds it:
    # PrepareConfig's is required; VerifierOptions carries capture-only fields), but the
    # same declaration.
    tokenizer: VerifierTokenizer = None
    # Not ProducerConfig's (the stream's shuffle seed): the answers' sampling seed.
    seed: int = Field(0, description="sampling seed; each answer's is derived from it")
    # Not VerifierOptions' (nor ProducerConfig's): those also carry capture-only fields
    # (storage dtype, layers).
    device: str = Field("auto", description="hf engine: auto (CUDA if present) | cpu | cuda:N")
    # Not VerifierOptions' (nor ProducerConfig's), as --device.
    dtype: DTypeName = Field("auto", description="hf engine: auto = bf16 on CUDA, fp32 on CPU")
    records_per_shard: int = Field(64, ge=1, description="input records per output shard")
    max_records: int | None = limit_flag("only the first N input records")

    @field_validator("data")
    @classmethod
    def _files_exist(cls, v: list[str]) -> list[str]:
        return existing_files(v)

    def chat_format(self) -> ChatFormat:
        return ChatFormat(**{k: getattr(self, k) for k in ChatFormat.model_fields})


# --------------------------------------------------------------------------- input


@dataclass(slots=True)
class Item:
    """One input record: its index over all inputs, where it came from, and the
    conversation (None with `error` for a bad row)."""

    index: int
    where: str
    conv: Conversation | None
    error: str | None = None


def iter_items(cfg: RegenerateConfig) -> Iterator[Item]:
    """Every input record in order, converted; a bad row raises unless --on-bad-row skip."""
    index = 0
    for path in cfg.data:
        fmt: ChatFormat | None = None
        for (file, first), items, raw, _ in iter_raw_chunks(path, 256):
            for k, it in enumerate(items):
                line = it[0] if raw else first + k
                try:
                    rec = json.loads(it[1]) if raw else it
                    if fmt is None:
                        fmt = detect_format([rec], cfg.chat_format())
                    item = Item(index, f"{file}:{line}", to_conversation(rec, fmt, file, line))
                except (BadRow, ValueError, ConfigError) as e:
                    err = (
                        e
                        if isinstance(e, BadRow | ConfigError)
                        else BadRow(file, line, "<json>", f"bad JSON: {e}")
                    )
                    if cfg.on_bad_row == "error":
                        raise err from None
                    item = Item(index, f"{file}:{line}", None, f"bad row: {err}")
                yield item
                index += 1
                if cfg.max_records is not None and index >= cfg.max_records:
                    return


def count_items(cfg: RegenerateConfig) -> int:
    """Input records, for the progress bar's total. Every record is converted, so a bad
    row stops the command (unless --on-bad-row skip) before the verifier is loaded."""
    return sum(1 for _ in iter_items(cfg))


def inputs_fingerprint(paths: list[str]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        h = hasher()
        with open(p, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        out.append({"file": Path(p).name, "bytes": Path(p).stat().st_size, "hash": labelled(h)})
    return out


def software() -> dict[str, Any]:
    """What wrote a record (each record's `fanout_regen.software`): fanout's version
    (package metadata) and git commit (`source_commit`), torch's and transformers'
    versions; None for what is not installed or not known."""
    import fanout

    commit, modified = source_commit(Path(fanout.__file__))  # the whole package's folder
    return {
        "fanout": fanout.package_version("fanout"),
        "fanout_commit": commit,
        "fanout_modified": modified,
        "torch": fanout.package_version("torch"),
        "transformers": fanout.package_version("transformers"),
    }


def source_commit(path: Path) -> tuple[str | None, bool | None]:
    """(HEAD commit, whether tracked files of `path`'s folder differ from it) of the git
    checkout that tracks `path`; (None, None) when none does (an installed wheel, a copy)
    or git is not there. Never raises: provenance must not stop a run."""
    here = str(path.parent)

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", "-C", here, *args], capture_output=True, text=True, timeout=30
        )

    try:
        # tracked, not just inside a checkout: a venv's site-packages under a repo is not
        if git("ls-files", "--error-unmatch", path.name).returncode != 0:
            return None, None
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None, None
        diff = git("diff", "--quiet", "HEAD", "--", ".").returncode
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head.stdout.strip(), None if diff not in (0, 1) else diff == 1


# --------------------------------------------------------------------------- one shard


def chosen_turns(conv: Conversation, turns: str) -> list[int] | str:
    """Indices of the assistant messages to regenerate, or why there are none."""
    idx = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    plain = [i for i in idx if not conv.messages[i].get("tool_calls")]
    if turns == "last":
        return [idx[-1]] if idx[-1] in plain else "the last assistant turn is a tool call"
    return plain or "every assistant turn is a tool call"


@dataclass
class ShardResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


class Regenerator:
    """Regenerates shards of input records with one engine (also the producer's, under
    `fanout produce --regenerate`)."""

    def __init__(
        self, engine: Engine, opts: RegenOptions, seed: int, verifier: dict[str, Any] | None
    ) -> None:
        self.engine, self.opts, self.seed = engine, opts, seed
        self.base = {
            "verifier": verifier,
            "engine": engine.describe(),
            "sampling": opts.sampling(),
            "seed": seed,
            "turns": opts.turns,
            "software": software(),
        }

    def shard(self, items: list[Item]) -> ShardResult:
        """The kept, regenerated records of `items` (in order) and the shard's summary."""
        msgs: dict[int, list[dict[str, Any]]] = {}
        todo: dict[int, list[int]] = {}
        prov: dict[int, list[dict[str, Any]]] = {}
        skipped: list[dict[str, Any]] = []
        by_index = {it.index: it for it in items}
        counts = {
            "records": len(items),
            "kept": 0,
            "truncated_kept": 0,
            "truncated_dropped": 0,
            "skipped": 0,
        }
        tokens = {"prompt_tokens": 0, "answer_tokens": 0}

        def skip(it: Item, reason: str) -> None:
            skipped.append({"index": it.index, "where": it.where, "reason": reason})
            todo.pop(it.index, None)

        for it in items:
            if it.conv is None:
                skip(it, it.error or "bad row")
                continue
            plan = chosen_turns(it.conv, self.opts.turns)
            if isinstance(plan, str):
                skip(it, plan)
                continue
            msgs[it.index] = [dict(m) for m in it.conv.messages]
            todo[it.index], prov[it.index] = plan, []
        while todo:  # step j: every live record's j-th chosen turn, in one engine call
            keys = sorted(todo)
            reqs = [
                Request((k, todo[k][0]), msgs[k][: todo[k][0]], by_index[k].conv.tools,  # type: ignore[union-attr]
                        record_seed(self.seed, k, todo[k][0]))
                for k in keys
            ]  # fmt: skip
            for req, ans in zip(reqs, self.engine.generate(reqs), strict=True):
                k, m = req.key
                tokens["prompt_tokens"] += ans.prompt_tokens
                tokens["answer_tokens"] += ans.answer_tokens
                reason = self._problem(ans)
                if reason is not None:
                    counts["truncated_dropped"] += reason.startswith("truncated")
                    skip(by_index[k], reason)
                    continue
                counts["truncated_kept"] += ans.finish_reason == "length"
                msgs[k][m] = assistant_message(ans.text)
                prov[k].append({
                    "message": m, "seed": req.seed, "finish_reason": ans.finish_reason,
                    "prompt_tokens": ans.prompt_tokens, "answer_tokens": ans.answer_tokens,
                })  # fmt: skip
                todo[k].pop(0)
                if not todo[k]:
                    del todo[k]
        out = ShardResult()
        for it in items:
            if it.index in msgs and not any(s["index"] == it.index for s in skipped):
                rec: dict[str, Any] = {"messages": msgs[it.index]}
                if it.conv is not None and it.conv.tools:
                    rec["tools"] = it.conv.tools
                rec["fanout_regen"] = {
                    "index": it.index,
                    "source": it.where,
                    **self.base,
                    "answers": prov[it.index],
                }
                out.records.append(rec)
        counts["kept"] = len(out.records)
        counts["skipped"] = len(skipped)
        out.summary = {**counts, **tokens, "skipped_records": skipped}
        return out

    def _problem(self, ans: Answer) -> str | None:
        if ans.error is not None:
            return f"failed: {ans.error}"
        if ans.finish_reason == "length" and not self.opts.keep_truncated:
            return f"truncated at --max-new-tokens {self.opts.max_new_tokens}"
        if not ans.text.strip() or not assistant_message(ans.text)["content"]:
            return "empty answer"
        return None


# --------------------------------------------------------------------------- the command


def fingerprints(cfg: RegenerateConfig) -> tuple[dict[str, Any] | None, str | None]:
    """(verifier fingerprint, tokenizer fingerprint), None where not given (openai)."""
    from fanout.data.template import tokenizer_dir, tokenizer_fingerprint
    from fanout.model.verifier import config_hash, weights_fingerprint

    if cfg.verifier_name_or_path is None:
        if cfg.engine == "hf":
            raise ConfigError(
                "--engine hf needs --verifier-name-or-path (a local HF model directory)"
            )
        return None, None
    try:
        verifier = {
            "config_sha256": config_hash(cfg.verifier_name_or_path),
            "weights": weights_fingerprint(cfg.verifier_name_or_path),
        }
    except ConfigError as e:
        raise ConfigError(f"--verifier-name-or-path: {e}") from None
    if cfg.engine == "openai":
        return verifier, None
    return verifier, tokenizer_fingerprint(tokenizer_dir(cfg.tokenizer, cfg.verifier_name_or_path))


def planned_engine(cfg: RegenerateConfig) -> dict[str, Any]:
    """`describe()` of the engine `make_engine(cfg)` builds, known before it loads the
    verifier or asks a server: what --out is checked against first."""
    if cfg.engine == "openai":
        from fanout.regen.openai import description

        return description(cfg.model)
    from fanout.regen.hf import planned_description

    return planned_description(cfg.device, cfg.dtype)


def make_engine(cfg: RegenerateConfig, verifier: Any = None) -> Engine:
    """The engine `cfg` asks for; `verifier`: an already loaded one for the hf engine."""
    if cfg.engine == "openai":
        from fanout.regen.openai import OpenAIEngine

        return OpenAIEngine.connect(cfg)
    from fanout.regen.hf import HFEngine, load_tokenizer

    assert cfg.verifier_name_or_path is not None  # fingerprints() said so
    tok = cfg.tokenizer or cfg.verifier_name_or_path
    if verifier is not None:
        return HFEngine(verifier, load_tokenizer(tok), cfg)
    return HFEngine.load(cfg.verifier_name_or_path, tok, cfg, device=cfg.device, dtype=cfg.dtype)


def identity(
    cfg: RegenerateConfig, engine: dict[str, Any], verifier: Any, tokenizer: str | None
) -> dict[str, Any]:
    """What decides the output's text: a resumed run must match it (fanout.regen.shards).
    `engine`: the engine's `describe()` (or `planned_engine(cfg)` before it exists)."""
    ident = {
        "inputs": inputs_fingerprint(cfg.data),
        "chat_format": cfg.chat_format().model_dump(mode="json"),
        "verifier": verifier,
        "tokenizer": tokenizer,
        "engine": engine,
        "sampling": cfg.sampling(),
        "seed": cfg.seed,
        "turns": cfg.turns,
        "keep_truncated": cfg.keep_truncated,
        "records_per_shard": cfg.records_per_shard,
        "max_records": cfg.max_records,
    }
    if cfg.engine == "hf":
        ident["regen_batch_size"] = cfg.regen_batch_size  # batches decide fp rounding
    return ident


def regenerate(cfg: RegenerateConfig, engine: Engine | None = None) -> dict[str, Any]:
    """Regenerate `cfg.data` into `cfg.out` (resuming what is there); returns the summary."""
    from tqdm import tqdm

    total = count_items(cfg)
    verifier, tok = fingerprints(cfg)
    out = OutDir(cfg.out)
    if engine is None:  # an --out made with other settings is refused before any loading
        ident = identity(cfg, planned_engine(cfg), verifier, tok)
        out.check(ident)
        engine = make_engine(cfg)
        ident["engine"] = engine.describe()  # the same, unless a load decided otherwise
    else:
        ident = identity(cfg, engine.describe(), verifier, tok)
    out.open(ident)
    regen = Regenerator(engine, cfg, cfg.seed, verifier)
    totals: dict[str, int] = {}
    bar = tqdm(
        total=total, desc="regenerate", unit="rec", disable=not (cfg.progress and draws_progress())
    )
    t0, new_tokens, shards = time.monotonic(), 0, 0
    items = iter_items(cfg)
    while chunk := list(islice(items, cfg.records_per_shard)):
        summary = out.done(shards)
        if summary is None:
            result = regen.shard(chunk)
            out.write_shard(shards, result.records, result.summary)
            summary = result.summary
            new_tokens += summary["answer_tokens"]
            rate = new_tokens / max(time.monotonic() - t0, 1e-9)
            bar.set_postfix_str(
                f"{rate:.1f} tok/s, {totals.get('skipped', 0) + summary['skipped']} skipped"
            )
        for k, v in summary.items():
            if isinstance(v, int):
                totals[k] = totals.get(k, 0) + v
        bar.update(len(chunk))
        shards += 1
    bar.close()
    joined = out.finish(shards, totals)
    return {"out": str(joined), "shards": shards, **totals}


def producer_config(
    prep: PrepareConfig,
    opts: RegenOptions,
    *,
    seed: int,
    verifier_dir: str,
    out: Path,
    records_per_shard: int,
) -> RegenerateConfig:
    """`fanout produce --regenerate`: the `fanout regenerate` config that regenerates
    `prep`'s data into `out` with the producer's settings, so the saved directory is the
    one that command writes with the same flags (fanout.produce.onpolicy streams it)."""
    chat = {k: getattr(prep, k) for k in ChatFormat.model_fields}
    return RegenerateConfig(
        **chat | opts.regen_options(),
        data=prep.data,
        out=str(out),
        verifier_name_or_path=verifier_dir,
        tokenizer=prep.tokenizer,
        seed=seed,
        records_per_shard=records_per_shard,
        on_bad_row=prep.on_bad_row,
        progress=False,
    )


def add_arguments(p: argparse.ArgumentParser, name: str = "regenerate") -> None:
    add_model_flags(p, RegenerateConfig)


def config_from_args(args: argparse.Namespace) -> RegenerateConfig:
    return model_from_args(RegenerateConfig, args)


def run(args: argparse.Namespace, name: str = "regenerate") -> int:
    summary = regenerate(config_from_args(args))
    print(json.dumps(summary, indent=2))
    return 0
