"""The project's own tiny assets: a synthetic chat corpus, a BPE tokenizer and a small Qwen3.

    python -m fanout.bench.assets --cache-dir runs/assets          # builds once (~1 min on 2 cores), then instant
    python -c "from fanout.bench.assets import ensure_demo_assets as e; print(e('runs/assets'))"

The demo must run on a fresh machine with only Python and this repo, so it cannot
download a tokenizer or a verifier. This module makes them:

- `generate_corpus`: chat conversations (OpenAI `messages` shape) from templates with
  learnable structure — arithmetic, counting, repeating patterns, spelling, reversal,
  a small fact table — so a tiny model learns non-trivial greedy predictions in seconds.
- `build_tokenizer`: a byte-level BPE (HF `tokenizers`) with ChatML special tokens and
  a ChatML `chat_template`, loadable offline with `AutoTokenizer.from_pretrained`.
- `build_verifier`: a tiny Qwen3 trained briefly on that corpus, saved with
  `save_pretrained` (safetensors) so it loads through the same path users take.
- `ensure_demo_assets`: all three, cached under a fingerprint of the generator version
  and settings, built in a temp dir and renamed into place (atomic).
- `tiny_qwen3_verifier`: an untrained random tiny Qwen3 for tests (~1 s), any vocab size.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from fanout.filesystem import FileSystem
from fanout.hashing import identity_digest

log = logging.getLogger(__name__)

# Bump when the corpus templates, tokenizer recipe or model recipe change: it is part
# of the cache fingerprint, so old caches are rebuilt rather than silently reused.
GENERATOR_VERSION = 1
DEFAULT_TRAIN_STEPS = 200  # ~0.1-0.3 s/step on 2 cores; final loss ≈ 0.66 nats (uniform ≈ 6.8)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# <|MASK|> is the DFlash mask token (same name SGLang's DFlash worker uses by default).
MASK_TOKEN = "<|MASK|>"
RESERVED_TOKENS = [MASK_TOKEN, *(f"<|reserved_{i}|>" for i in range(3))]

# ChatML, as Qwen uses. {% generation %} marks assistant content so HF's
# return_assistant_tokens_mask works; the rendered text is plain ChatML.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# --------------------------------------------------------------------------- corpus

_FACTS = {
    "capital of France": "Paris",
    "capital of Japan": "Tokyo",
    "capital of Italy": "Rome",
    "capital of Egypt": "Cairo",
    "capital of Peru": "Lima",
    "color of the sky": "blue",
    "color of grass": "green",
    "color of snow": "white",
    "number of legs of a spider": "eight",
    "number of days in a week": "seven",
    "opposite of hot": "cold",
    "opposite of up": "down",
    "opposite of left": "right",
    "largest planet": "Jupiter",
}
_WORDS = [
    "apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "robot",
    "garden", "window", "planet", "candle", "silver", "forest", "rocket", "pencil",
]  # fmt: skip
_SYSTEMS = ["You are a helpful assistant.", "You are a careful tutor.", "Answer briefly."]


def _arith(r: random.Random) -> tuple[str, str]:
    a, b = r.randint(0, 99), r.randint(0, 99)
    op = r.choice("+-*")
    if op == "*":
        a, b = a % 13, b % 13
    val = a + b if op == "+" else a - b if op == "-" else a * b
    q = r.choice(["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?"])
    return q.format(a=a, op=op, b=b), f"{a} {op} {b} = {val}."


def _count(r: random.Random) -> tuple[str, str]:
    a = r.randint(0, 40)
    n = r.randint(3, 9)
    step = r.choice([1, 1, 2, 5])
    seq = ", ".join(str(a + i * step) for i in range(n))
    return f"Count from {a} in steps of {step}, {n} numbers.", f"{seq}."


def _repeat(r: random.Random) -> tuple[str, str]:
    unit = r.choice(["ab", "xyz", "la", "ping pong", "1 2 3", "tick tock"])
    n = r.randint(2, 6)
    return f"Repeat '{unit}' {n} times.", " ".join([unit] * n)


def _spell(r: random.Random) -> tuple[str, str]:
    w = r.choice(_WORDS)
    return f"Spell the word {w}.", "-".join(w.upper())


def _reverse(r: random.Random) -> tuple[str, str]:
    w = r.choice(_WORDS)
    return f"Reverse the word {w}.", f"The word {w} reversed is {w[::-1]}."


def _fact(r: random.Random) -> tuple[str, str]:
    k = r.choice(sorted(_FACTS))
    return f"What is the {k}?", f"The {k} is {_FACTS[k]}."


def _alphabet(r: random.Random) -> tuple[str, str]:
    i = r.randint(0, 18)
    n = r.randint(3, 7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return f"List {n} letters starting at {letters[i]}.", " ".join(letters[i : i + n])


_TASKS = [_arith, _count, _repeat, _spell, _reverse, _fact, _alphabet]


def generate_corpus(
    n_conversations: int, seed: int, out_path: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """Synthetic chat conversations `{"messages": [{"role", "content"}, ...]}`, deterministic in seed.

    Each has an optional system turn and 1–3 user/assistant exchanges drawn from
    the templates above. With `out_path`, also written as JSONL (one per line).
    """
    if n_conversations < 0:
        raise ValueError(f"n_conversations must be >= 0, got {n_conversations}")
    r = random.Random(seed)
    convs: list[dict[str, Any]] = []
    for _ in range(n_conversations):
        msgs: list[dict[str, str]] = []
        if r.random() < 0.3:
            msgs.append({"role": "system", "content": r.choice(_SYSTEMS)})
        for _ in range(r.choice([1, 1, 2, 3])):
            q, a = r.choice(_TASKS)(r)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        convs.append({"messages": msgs})
    if out_path is not None:
        write_jsonl(out_path, convs)
    return convs


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def render_chatml(messages: list[dict[str, str]]) -> str:
    """The same text CHAT_TEMPLATE renders (used for tokenizer and model training)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer(
    out_dir: str | os.PathLike[str], corpus: list[dict[str, Any]], vocab_size: int = 1024
) -> Path:
    """Train a byte-level BPE on the corpus; write tokenizer.json + tokenizer_config.json.

    Special tokens: <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos), <|MASK|> (the
    DFlash mask token) and a few reserved ones. Loads offline with
    `AutoTokenizer.from_pretrained(out_dir)`; `apply_chat_template` renders ChatML.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + RESERVED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (m["content"] for c in corpus for m in c["messages"])
    roles = ["system", "user", "assistant"] * 50  # role names must merge like real text
    tok.train_from_iterator([*roles, *texts], trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", *RESERVED_TOKENS],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


# --------------------------------------------------------------------------- models


def _random_qwen3(
    vocab_size: int,
    seed: int,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 192,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    tie_word_embeddings: bool = False,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Any:
    """A randomly initialised Qwen3ForCausalLM (fp32) of these shapes, seeded with
    `seed`: the one place the tiny verifiers' shapes and their defaults are declared."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


def tiny_qwen3_verifier(
    out_dir: str | os.PathLike[str],
    vocab_size: int,
    *,
    intermediate_size: int = 128,
    seed: int = 0,
    **shape: Any,
) -> Path:
    """An untrained random tiny Qwen3 saved with `save_pretrained` (fp32 safetensors);
    `shape`: `hidden_size` (64), `num_layers` (6), `num_heads` (4), `num_kv_heads` (2),
    `head_dim` (16), `tie_word_embeddings` (False).

    Six layers by default so the DFlash layer rule gives distinct ids for up to 3
    draft layers ([1, 3] for two). Works with the real Qwen3 vocabulary (151,669)
    too: ~20M parameters then, mostly embedding + lm_head.
    """
    model = _random_qwen3(vocab_size, seed, intermediate_size=intermediate_size, **shape)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def tiny_verifier_for_tokenizer(
    out_dir: str | os.PathLike[str], tokenizer_dir: str | os.PathLike[str], **kw: Any
) -> Path:
    """`tiny_qwen3_verifier` sized to the vocabulary of `tokenizer_dir/tokenizer.json`."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).get_vocab_size()
    return tiny_qwen3_verifier(out_dir, vocab, **kw)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on `n` torch threads, then restore the count (tiny models: their
    forwards are per-op overhead, and more threads only contend on a busy CPU)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_verifier(
    out_dir: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str],
    corpus: list[dict[str, Any]],
    *,
    train_steps: int = DEFAULT_TRAIN_STEPS,
    seed: int = 0,
    seq_len: int = 128,
    batch_rows: int = 16,
    lr: float = 4e-3,
    hidden_size: int = 64,
    num_layers: int = 6,
    intermediate_size: int = 192,
) -> Path:
    """Train a tiny Qwen3 briefly on the corpus (next-token CE on packed ChatML text); save it.

    Writes `training.json` beside the weights with the first/final training loss
    and wall time. Deterministic in `seed` (single-threaded order of data; the
    float results can still differ across CPUs/BLAS builds).
    """
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    assert isinstance(eos, int) and isinstance(pad, int)  # one token each
    model = _random_qwen3(
        len(tok),
        seed,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    stream = _token_stream(tok, corpus)  # 1-D int64
    n_rows = len(stream) // seq_len
    if n_rows < batch_rows:
        raise ValueError(f"corpus too small: {len(stream)} tokens for {batch_rows}×{seq_len} rows")
    rows = stream[: n_rows * seq_len].view(n_rows, seq_len)  # [N, T]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / train_steps))
    )
    g = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.monotonic()
    losses: list[float] = []
    # One thread: the ops are tiny, so extra OpenMP threads only add barrier waits —
    # measured 3x slower per step (and 4x the CPU) with 2 threads on 2 busy cores.
    with torch_threads(1):
        for _ in range(train_steps):
            batch = rows[torch.randint(n_rows, (batch_rows,), generator=g)]  # [b, T]
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
    model.eval()
    out = Path(out_dir)
    model.save_pretrained(out)
    report = {
        "train_steps": train_steps,
        "tokens_per_step": batch_rows * seq_len,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "seconds": round(time.monotonic() - t0, 2),
        "uniform_loss": math.log(len(tok)),
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    log.info("tiny verifier trained: %s", report)
    return out


def _token_stream(tok: Any, corpus: list[dict[str, Any]]) -> Any:
    import torch

    ids: list[int] = []
    for c in corpus:
        ids += tok.apply_chat_template(c["messages"], tokenize=True, return_dict=False)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- cache


@dataclass(frozen=True, slots=True)
class DemoAssets:
    """Paths of a built asset set (all under one cached directory)."""

    tokenizer_dir: Path
    verifier_dir: Path
    data_path: Path
    mask_token_id: int
    root: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class AssetSettings:
    """What the demo assets are built from; every field is part of the cache key."""

    n_conversations: int = 4000
    seed: int = 0
    vocab_size: int = 1024
    train_steps: int = DEFAULT_TRAIN_STEPS
    seq_len: int = 128
    hidden_size: int = 64
    num_layers: int = 6

    def __post_init__(self) -> None:
        for name in ("n_conversations", "vocab_size", "train_steps", "seq_len", "hidden_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AssetSettings.{name} must be > 0, got {getattr(self, name)}")
        if self.num_layers < 4:
            raise ValueError(f"AssetSettings.num_layers must be >= 4, got {self.num_layers}")

    def fingerprint(self) -> str:
        return identity_digest({"generator_version": GENERATOR_VERSION, **asdict(self)})[:16]


def ensure_demo_assets(
    cache_dir: str | os.PathLike[str], settings: AssetSettings | None = None
) -> DemoAssets:
    """Build the tokenizer, verifier and corpus once; later calls return the cached set.

    The set lives in `cache_dir/demo-assets-<fingerprint>/` (fingerprint of
    GENERATOR_VERSION + settings). It is built in a temp dir and renamed into place
    under a file lock, so a crash leaves no half-built set and two concurrent
    callers build it once.
    """
    s = settings or AssetSettings()
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"demo-assets-{s.fingerprint()}"
    with FileLock(str(final) + ".lock"):
        if not (final / "assets.json").is_file():
            tmp = cache / f".tmp-{final.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _build(tmp, s)
                # an existing `final` is debris without assets.json from an older crash:
                # commit_dir sets it aside and removes it
                FileSystem().commit_dir(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    manifest = json.loads((final / "assets.json").read_text())
    return DemoAssets(
        tokenizer_dir=final / "tokenizer",
        verifier_dir=final / "verifier",
        data_path=final / "data" / "chat.jsonl",
        mask_token_id=int(manifest["mask_token_id"]),
        root=final,
    )


def _build(root: Path, s: AssetSettings) -> None:
    t0 = time.monotonic()
    corpus = generate_corpus(s.n_conversations, s.seed, root / "data" / "chat.jsonl")
    tok_dir = build_tokenizer(root / "tokenizer", corpus, s.vocab_size)
    ver_dir = build_verifier(
        root / "verifier",
        tok_dir,
        corpus,
        train_steps=s.train_steps,
        seed=s.seed,
        seq_len=s.seq_len,
        hidden_size=s.hidden_size,
        num_layers=s.num_layers,
    )
    from tokenizers import Tokenizer

    mask_id = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).token_to_id(MASK_TOKEN)
    manifest = {
        "generator_version": GENERATOR_VERSION,
        "settings": asdict(s),
        "mask_token": MASK_TOKEN,
        "mask_token_id": mask_id,
        "training": json.loads((ver_dir / "training.json").read_text()),
        "build_seconds": round(time.monotonic() - t0, 2),
    }
    # Written last: its presence marks a complete set.
    (root / "assets.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build (or find cached) fanout demo assets.")
    p.add_argument("--cache-dir", required=True, help="directory holding cached asset sets")
    p.add_argument(
        "--train-steps",
        type=int,
        default=DEFAULT_TRAIN_STEPS,
        help="optimizer steps of the tiny verifier",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = ensure_demo_assets(
        args.cache_dir, AssetSettings(train_steps=args.train_steps, seed=args.seed)
    )
    print(json.dumps({k: str(v) for k, v in asdict(a).items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
