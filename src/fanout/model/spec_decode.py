"""Greedy decoding with the verifier alone, and DFlash speculative decoding, for one prompt.

    from fanout.model.spec_decode import Decoder
    dec = Decoder(verifier, eos_token_ids={2})        # a fanout.model.verifier.Verifier
    plain = dec.greedy(prompt_ids, max_new_tokens=64)  # one verifier forward per token
    spec = dec.speculative(prompt_ids, draft, max_new_tokens=64)
    assert spec.tokens == plain.tokens                 # lossless: the defining property
    print(spec.acceptance_length)                      # tokens per verifier forward (τ)

This is the serving loop an engine runs (vLLM's DFlash proposer does the same steps with
batching and paged KV), written plainly so it can be checked token for token:

1. Prefill: the verifier runs the prompt (KV cache kept); its argmax at the last position
   is the first new token, and the hidden states of the draft's layers at every prompt
   position become the draft's context.
2. Draft: the block `[x_p, MASK, ..., MASK]` anchored at the last accepted token `x_p`
   (position p) attends to the context at positions `< p` (`fanout.model.anchors`: the
   anchor's own hidden state does not exist yet — it is the verifier's bonus token) and
   proposes `block_size - 1` tokens in one forward (`DFlashDraft.propose`).
3. Verify: the verifier runs `[x_p, d_1, ..., d_{bs-1}]` at positions p.. in one forward
   on top of its cache. Its argmax `y_k` at slot k is its own choice for position p+k+1.
   The drafts are accepted while `d_{k+1} == y_k`; with n accepted, the tokens
   `d_1..d_n, y_n` are appended (n + 1 tokens for one verifier forward: the acceptance
   length). The cache is cropped back to the accepted prefix (the rejected slots' keys
   are rolled back) and the hidden states of the n + 1 kept positions join the context.

Every appended token is a verifier argmax given exactly the tokens before it, so the
output equals plain greedy decoding — up to floating-point differences between a
one-token and a multi-token forward, which fp32 on CPU keeps far below any argmax
margin the tests meet (they require zero mismatches).

Cost: the draft recomputes its context projection (fc + per-layer k/v of all p context
positions) every block; an engine caches those. Fine for evaluation, not for serving.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fanout.model.dflash import DFlashDraft


@dataclass
class DecodeResult:
    """One prompt's decode. Counts exclude the prefill forward (the same in both modes)."""

    tokens: list[int]  # generated ids, prompt excluded, EOS included when hit
    forwards: int  # verifier forwards after the prefill
    seconds: float  # wall time of the whole decode, prefill included
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per verify
    block_size: int = 0  # draft block size (0 for plain greedy)

    @property
    def acceptance_length(self) -> float:
        """τ: tokens appended per verifier forward, the bonus token included."""
        if not self.accepted:
            return 1.0
        return sum(n + 1 for n in self.accepted) / len(self.accepted)

    def position_accepted(self) -> list[int]:
        """How many verify steps accepted the draft token at block position k (1..bs-1)."""
        return [sum(1 for n in self.accepted if n >= k) for k in range(1, self.block_size)]


class Decoder:
    """Greedy and speculative decoding of single prompts on one loaded verifier."""

    def __init__(self, verifier: Any, eos_token_ids: set[int] | frozenset[int]) -> None:
        self.verifier = verifier
        self.model = verifier.model
        self.layers = verifier.layers
        self.device: torch.device = verifier.device
        self.eos = frozenset(int(e) for e in eos_token_ids)
        # transformers renamed `past_key_values` to `cache` (5.2x warns on the old name)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ---- the verifier ----------------------------------------------------------------

    def _forward(
        self,
        ids: list[int],
        start: int,
        cache: Any,
        layer_ids: list[int] | None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids` at positions start.. on top of `cache`. Returns the argmax of each
        position's logits `[n]` (only the last with `last_only`) and, for `layer_ids`, the
        decoder-layer outputs `[n, len(layer_ids)·H]` (the capture rule of
        `fanout.model.verifier`: output of decoder layer i = HF hidden_states[i + 1])."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, n]
        pos = torch.arange(start, start + len(ids), device=self.device)[None]  # [1, n]
        outs: list[torch.Tensor] = []
        handles = []
        for i in layer_ids or []:

            def hook(_m: Any, _a: Any, out: Any) -> None:
                outs.append(out[0] if isinstance(out, tuple) else out)  # [1, n, H]

            handles.append(self.layers[i].register_forward_hook(hook))
        try:
            out = self.model(
                input_ids=x,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
                **{self._cache_kw: cache},
            )
        finally:
            for h in handles:
                h.remove()
        pred = out.logits[0].argmax(dim=-1)  # [n] or [1]
        hidden = torch.cat(outs, dim=-1)[0] if layer_ids else None  # [n, k·H]
        return pred, hidden

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _done(self, tokens: list[int], max_new_tokens: int) -> bool:
        return len(tokens) >= max_new_tokens or (bool(tokens) and tokens[-1] in self.eos)

    def _clip(self, tokens: list[int], max_new_tokens: int) -> list[int]:
        """Cut at the first EOS (kept) and at max_new_tokens."""
        for j, t in enumerate(tokens):
            if t in self.eos:
                tokens = tokens[: j + 1]
                break
        return tokens[:max_new_tokens]

    # ---- decoding --------------------------------------------------------------------

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> DecodeResult:
        """Plain greedy decoding: one verifier forward per new token."""
        t0 = time.perf_counter()
        cache = self._new_cache()
        pred, _ = self._forward(prompt, 0, cache, None, last_only=True)
        tokens = [int(pred[-1])]
        forwards = 0
        while not self._done(tokens, max_new_tokens):
            pred, _ = self._forward([tokens[-1]], len(prompt) + len(tokens) - 1, cache, None)
            tokens.append(int(pred[-1]))
            forwards += 1
        self._sync()
        return DecodeResult(tokens, forwards, time.perf_counter() - t0)

    @torch.inference_mode()
    def speculative(
        self, prompt: list[int], draft: DFlashDraft, max_new_tokens: int
    ) -> DecodeResult:
        """DFlash speculative decoding (module docstring); lossless w.r.t. `greedy`."""
        t0 = time.perf_counter()
        bs = draft.cfg.block_size
        layer_ids = list(draft.cfg.target_layer_ids)
        dtype = draft.fc.weight.dtype
        cache = self._new_cache()
        pred, hid = self._forward(prompt, 0, cache, layer_ids, last_only=True)
        assert hid is not None
        ctx = [hid.to(dtype)]  # context hidden states, positions 0..p-1: list of [n, k·H]
        tokens = [int(pred[-1])]
        accepted: list[int] = []
        while not self._done(tokens, max_new_tokens):
            p = len(prompt) + len(tokens) - 1  # position of the anchor (last accepted token)
            context = torch.cat(ctx)  # [p, k·H]
            proposal = draft.propose(context, tokens[-1])  # [bs - 1] verifier ids
            block = [tokens[-1], *proposal.tolist()]
            pred, hid = self._forward(block, p, cache, layer_ids)  # [bs], [bs, k·H]
            assert hid is not None
            y = pred.tolist()
            n = 0
            while n < bs - 1 and block[n + 1] == y[n]:
                n += 1
            accepted.append(n)
            # keep the anchor and the n accepted drafts; a negative count ("remove this
            # many") means the same in every transformers version that has crop
            cache.crop(-(bs - 1 - n)) if n < bs - 1 else None
            ctx.append(hid[: n + 1].to(dtype))
            new = [*block[1 : n + 1], y[n]]
            tokens.extend(new)
            if any(t in self.eos for t in new):
                break
        self._sync()
        tokens = self._clip(tokens, max_new_tokens)
        return DecodeResult(tokens, len(accepted), time.perf_counter() - t0, accepted, bs)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


__all__ = ["DecodeResult", "Decoder", "first_mismatch"]
