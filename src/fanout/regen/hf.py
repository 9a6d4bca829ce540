"""The embedded engine: the verifier answers in this process, batched, with a KV cache.

    from fanout.regen.hf import HFEngine
    engine = HFEngine.load("VERIFIER_DIR", "TOKENIZER_DIR", RegenOptions(), device="cpu")
    answers = engine.generate(requests)          # fanout.regen.engine.Request → Answer

Prompts are rendered with the tokenizer's own `apply_chat_template` (the chat
template kwargs pass through), sorted by length (then by key) and cut into batches
of `regen_batch_size`, so padding stays small; each batch is one HF `generate` call
with left padding and its KV cache. The batches are a function of the requests alone
(fanout.regen.regenerate hands over one shard's requests at a time), so a rerun or a
resumed run computes every batch exactly as before and writes the same text.

Sampling (temperature > 0) is ours, not HF's: `RowSampler` draws each row's token
with that row's own `torch.Generator` seeded by the request's seed, on the CPU, and
hands HF a one-hot score, so HF's greedy step takes it. A row's draws therefore do
not depend on the other rows of its batch. A batch that raises is retried one
request at a time; a request that fails alone gets its error as its answer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from fanout.errors import ConfigError
from fanout.model.sampling import Sampling, probabilities
from fanout.model.verifier import DTypeName, Verifier, load_verifier, resolve_device, resolve_dtype
from fanout.regen.engine import Answer, RegenOptions, Request

log = logging.getLogger(__name__)


class RowSampler:
    """A logits processor that samples each row with its own generator (temperature,
    top-k, top-p) and returns scores that make the sampled token the argmax."""

    def __init__(self, seeds: list[int], opts: RegenOptions) -> None:
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        # the processed distribution is fanout eval's (one rule for top-k / top-p)
        self.sampling = Sampling(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = probabilities(scores.cpu(), self.sampling)  # [B, V]
        picks = [int(torch.multinomial(probs[i], 1, generator=g)) for i, g in enumerate(self.gens)]
        out = torch.full_like(scores, float("-inf"))
        rows = torch.arange(len(picks), device=scores.device)
        out[rows, torch.tensor(picks, device=scores.device)] = 0.0
        return out


class HFEngine:
    """The verifier's HF model and tokenizer, answering batches of requests."""

    name = "hf"

    def __init__(self, verifier: Verifier, tokenizer: Any, opts: RegenOptions) -> None:
        self.verifier, self.tok, self.opts = verifier, tokenizer, opts
        self.model = verifier.model
        self.tok.padding_side = "left"
        pad = self.tok.pad_token_id
        eos: set[int] = set()
        for src in (
            self.tok.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            eos.update([src] if isinstance(src, int) else (src or []))
        if not eos:
            raise ConfigError(
                f"tokenizer {tokenizer.name_or_path}: no eos token; cannot stop answers"
            )
        self.eos = sorted(eos)
        self.pad = pad if pad is not None else self.eos[0]
        text_cfg = self.model.config.get_text_config()
        self.max_positions: int | None = getattr(text_cfg, "max_position_embeddings", None)
        self.template_kwargs = opts.template_kwargs()

    @classmethod
    def load(
        cls,
        verifier_dir: str,
        tokenizer_dir: str | None,
        opts: RegenOptions,
        *,
        device: str = "auto",
        dtype: Any = "auto",
    ) -> HFEngine:
        """Load the tokenizer, then the verifier (fanout.model.verifier), both offline: a
        tokenizer that cannot serve is refused before the weights are read."""
        tok = load_tokenizer(tokenizer_dir or verifier_dir)
        verifier = load_verifier(verifier_dir, device=device, dtype=dtype, capture_layer_ids="all")
        return cls(verifier, tok, opts)

    def describe(self) -> dict[str, Any]:
        return description(self.verifier.device, self.verifier.dtype)

    def render(self, req: Request) -> list[int]:
        text = self.tok.apply_chat_template(
            req.messages, tools=req.tools, add_generation_prompt=True, tokenize=False,
            **self.template_kwargs,
        )  # fmt: skip
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def generate(self, requests: list[Request]) -> list[Answer]:
        out: list[Answer | None] = [None] * len(requests)
        ready: list[tuple[int, list[int]]] = []
        for i, req in enumerate(requests):
            try:
                ids = self.render(req)
            except Exception as e:  # a template that refuses this conversation
                out[i] = Answer.failed(f"chat template: {type(e).__name__}: {e}")
                continue
            limit = self.max_positions
            if limit is not None and len(ids) + self.opts.max_new_tokens > limit:
                out[i] = Answer.failed(
                    f"prompt of {len(ids)} tokens + --max-new-tokens {self.opts.max_new_tokens} "
                    f"exceeds the verifier's max_position_embeddings {limit}", len(ids)
                )  # fmt: skip
                continue
            ready.append((i, ids))
        ready.sort(key=lambda x: (len(x[1]), requests[x[0]].key))  # buckets of similar length
        b = self.opts.regen_batch_size
        for s in range(0, len(ready), b):
            batch = ready[s : s + b]
            answers = self._batch_or_singles(
                [requests[i] for i, _ in batch], [ids for _, ids in batch]
            )
            for (i, _), a in zip(batch, answers, strict=True):
                out[i] = a
        return [a if a is not None else Answer.failed("not generated") for a in out]

    def _batch_or_singles(self, reqs: list[Request], prompts: list[list[int]]) -> list[Answer]:
        try:
            return self._generate(reqs, prompts)
        except Exception as e:
            if len(reqs) == 1:
                return [Answer.failed(f"generate: {type(e).__name__}: {e}", len(prompts[0]))]
            log.warning("batch of %d failed (%s); retrying one at a time", len(reqs), e)
        return [self._batch_or_singles([r], [p])[0] for r, p in zip(reqs, prompts, strict=True)]

    @torch.inference_mode()
    def _generate(self, reqs: list[Request], prompts: list[list[int]]) -> list[Answer]:
        from transformers import GenerationConfig, LogitsProcessorList

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)  # [B, L] left-padded
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        gen = GenerationConfig(
            do_sample=False, max_new_tokens=self.opts.max_new_tokens, pad_token_id=self.pad,
            eos_token_id=self.eos, temperature=None, top_p=None, top_k=None,
        )  # fmt: skip
        procs = LogitsProcessorList()
        if self.opts.temperature > 0:
            procs.append(RowSampler([r.seed for r in reqs], self.opts))
        dev = self.verifier.device
        seqs = self.model.generate(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=gen,
            logits_processor=procs,
        )  # fmt: skip
        new = seqs[:, width:].cpu()  # [B, <= max_new_tokens]
        return [self._answer(new[r].tolist(), len(p)) for r, p in enumerate(prompts)]

    def _answer(self, new: list[int], prompt_tokens: int) -> Answer:
        stop = next((j for j, t in enumerate(new) if t in self.eos), None)
        n = len(new) if stop is None else stop
        text = self.tok.decode(new[:n], skip_special_tokens=True)
        return Answer(text, "length" if stop is None else "stop", prompt_tokens, n)


def description(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The hf engine's `describe()` (what the manifest's identity records)."""
    return {"name": "hf", "device": str(device), "dtype": str(dtype)}


def planned_description(device: str, dtype: DTypeName) -> dict[str, Any]:
    """`describe()` of the engine `HFEngine.load(..., device=device, dtype=dtype)` gives,
    known before it loads: fanout regenerate checks --out against it first."""
    dev = resolve_device(device)
    return description(dev, resolve_dtype(dtype, dev))


def load_tokenizer(path: str) -> Any:
    """An HF tokenizer from a local directory (no network); ConfigError if it cannot."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ConfigError(f"--tokenizer {path}: not a directory")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"--tokenizer {path}: cannot load a tokenizer: {e}") from None
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"--tokenizer {path}: the tokenizer has no chat template")
    return tok
