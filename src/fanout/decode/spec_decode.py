"""Greedy decoding with the verifier alone, and DFlash speculative decoding, for one prompt.

    from fanout.decode.spec_decode import Decoder
    dec = Decoder(verifier, eos_token_ids={2})        # a fanout.model.verifier.Verifier
    plain = dec.greedy(prompt_ids, max_new_tokens=64)  # one verifier forward per token
    spec = dec.speculative(prompt_ids, draft, max_new_tokens=64)
    assert spec.tokens == plain.tokens                 # lossless: the defining property
    print(spec.acceptance_length)                      # tokens per verifier forward (τ)
    hot = dec.speculative(prompt_ids, draft, 64, Sampling(1.0), torch.Generator().manual_seed(0))

This is the serving loop an engine runs (vLLM's DFlash proposer does the same steps with
batching and paged KV), written plainly so it can be checked token for token:

1. Prefill: the verifier runs the prompt (KV cache kept); its argmax at the last position
   is the first new token, and the hidden states of the draft's layers at every prompt
   position become the draft's context.
2. Draft: the block `[x_p, MASK, ..., MASK]` anchored at the last accepted token `x_p`
   (position p) attends to the context at positions `< p` (`fanout.model.anchors`: the
   anchor's own hidden state does not exist yet — it is the verifier's bonus token) and
   proposes `block_size - 1` tokens in one forward (the family's drafting step).
3. Verify: the verifier runs `[x_p, d_1, ..., d_{bs-1}]` at positions p.. in one forward
   on top of its cache. Its argmax `y_k` at slot k is its own choice for position p+k+1.
   The drafts are accepted while `d_{k+1} == y_k`; with n accepted, the tokens
   `d_1..d_n, y_n` are appended (n + 1 tokens for one verifier forward: the acceptance
   length). The rejected slots are undone in every layer's state — keys, sliding
   windows, linear attention's recurrent state and convolution window
   (`fanout.decode.rollback`) — and the hidden states of the n + 1 kept positions join
   the context.

Every appended token is a verifier argmax given exactly the tokens before it, so the
output equals plain greedy decoding — up to floating-point differences between a
one-token and a multi-token forward (another summation order), which can flip an argmax
only where the verifier's top two logits tie to within a few rounding errors. fanout
eval tells such a tie from a real divergence (`Decoder.tie`): at the first differing
token it measures the verifier's own margin between the two tokens. Seen once in 1,120
demo prompts in fp32: logits 9.8586140 vs 9.8586130.

At T > 0 (`sampling=Sampling(T, top_p, top_k)`, a seeded `torch.Generator`) step 3
applies a rejection rule of `fanout.model.sampling` instead of the argmax match:
`rule="served"` (the draft's argmax tokens, as engines serve them) or
`rule="sampled_draft"` (draft tokens sampled from q, min(1, p/q)). Both are lossless in
distribution: the output is distributed as `sample` (plain sampling), not equal to it.

The draft's context k/v are cached (`fanout.model.draft_cache.DraftCache`: appended as
positions are accepted); `cache_draft=False` runs the uncached reference.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fanout.decode.rollback import Rollback
from fanout.families.registry import family_of_draft
from fanout.model.draft import Draft
from fanout.model.draft_cache import DraftContext
from fanout.model.sampling import Sampling, one_hot, probabilities, sample, verify_block

GREEDY = Sampling(0.0)
Rule = Literal["served", "sampled_draft"]
# How many epsilons of the verifier's dtype (relative to the logit) a one-token and a
# multi-token forward may differ by at a logit: an fp32 tie seen in the demo differed by
# 1 epsilon (1.0e-6 at 9.86); 16 leaves room for deeper verifiers, and stays ~1e-5
# relative in fp32, far below any margin a decoding bug produces.
TIE_ULPS = 16


@dataclass(frozen=True)
class Tie:
    """The verifier's margin between two next tokens and what rounding alone explains."""

    margin: float
    tolerance: float

    @property
    def is_tie(self) -> bool:
        return self.margin <= self.tolerance


@dataclass
class DecodeResult:
    """One prompt's decode. Counts exclude the prefill forward (the same in both modes)."""

    tokens: list[int]  # generated ids, prompt excluded, EOS included when hit
    forwards: int  # verifier forwards after the prefill
    seconds: float  # wall time of the whole decode, prefill included
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per verify
    block_size: int = 0  # the draft's block size (0 for plain greedy)
    prefill_seconds: float = 0.0  # the prefill forward (and the draft's first context)
    drafted: int = 0  # tokens drafted per verify step (0: bs - 1; DSpark drafts bs)
    # per verify step, the draft length the family itself proposes where it has a rule
    # for it (DSpark's confidence head); every drafted token is verified regardless
    proposed: list[int] = field(default_factory=list)

    @property
    def decode_seconds(self) -> float:
        """Wall time after the prefill: what speculative decoding changes."""
        return self.seconds - self.prefill_seconds

    @property
    def acceptance_length(self) -> float:
        """τ: tokens appended per verifier forward, the bonus token included."""
        if not self.accepted:
            return 1.0
        return sum(n + 1 for n in self.accepted) / len(self.accepted)

    @property
    def drafted_per_step(self) -> int:
        """Tokens a verify step drafts: `drafted`, else bs - 1 (a block after its anchor)."""
        return self.drafted or max(self.block_size - 1, 0)

    @property
    def verify_width(self) -> int:
        """Tokens one verify forward checks: the drafted ones and the bonus token (bs for
        DFlash, bs + 1 for DSpark, k + 1 for an EAGLE-3 chain of k)."""
        return self.drafted_per_step + 1

    def position_accepted(self) -> list[int]:
        """How many verify steps accepted the k-th drafted token (k = 1..drafted)."""
        k_max = self.drafted_per_step
        return [sum(1 for n in self.accepted if n >= k) for k in range(1, k_max + 1)]


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
        self.where = f"verifier {getattr(getattr(verifier, 'config', None), 'path', '')}"

    # ---- the verifier ----------------------------------------------------------------

    def _forward(
        self,
        ids: list[int],
        start: int,
        cache: Any,
        layer_ids: list[int] | None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids` at positions start.. on top of `cache`. Returns each position's logits
        `[n, V]` (only the last, `[1, V]`, with `last_only`) and, for `layer_ids`, the
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
        hidden = torch.cat(outs, dim=-1)[0] if layer_ids else None  # [n, k·H]
        return out.logits[0], hidden

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

    @staticmethod
    def _pick(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> int:
        """The token of the last row of `logits`: argmax at T = 0, else a draw from p."""
        if s.greedy:
            return int(logits[-1].argmax())
        assert gen is not None, "sampling needs a torch.Generator"
        return int(sample(probabilities(logits[-1:], s), gen)[0])

    # ---- decoding --------------------------------------------------------------------

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> DecodeResult:
        """Plain greedy decoding: one verifier forward per new token."""
        return self.sample(prompt, max_new_tokens, GREEDY, None)

    @torch.inference_mode()
    def sample(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        gen: torch.Generator | None,
    ) -> DecodeResult:
        """Plain decoding with the verifier alone, one forward per new token: argmax at
        T = 0 (`greedy`), else a draw from the processed distribution."""
        t0 = time.perf_counter()
        cache = self._new_cache()
        logits, _ = self._forward(prompt, 0, cache, None, last_only=True)
        tokens = [self._pick(logits, sampling, gen)]
        self._sync()
        prefill = time.perf_counter() - t0
        forwards = 0
        while not self._done(tokens, max_new_tokens):
            logits, _ = self._forward(
                [tokens[-1]], len(prompt) + len(tokens) - 1, cache, None
            )  # fmt: skip
            tokens.append(self._pick(logits, sampling, gen))
            forwards += 1
        self._sync()
        return DecodeResult(tokens, forwards, time.perf_counter() - t0, prefill_seconds=prefill)

    @torch.inference_mode()
    def speculative(
        self,
        prompt: list[int],
        draft: Draft,
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        gen: torch.Generator | None = None,
        rule: Rule = "served",
        *,
        cache_draft: bool = True,
        context: DraftContext | None = None,
    ) -> DecodeResult:
        """DFlash speculative decoding (module docstring): equal to `greedy` at T = 0,
        distributed as `sample` at T > 0. `context` replaces the draft's own (tests)."""
        t0 = time.perf_counter()
        bs = draft.cfg.block_size
        layer_ids = list(draft.cfg.target_layer_ids)
        cache = self._new_cache()
        if context is None:  # the family's drafting step
            context = family_of_draft(draft).context(draft, cached=cache_draft)
        rollback = Rollback(cache, self.where)  # refuses a layer it cannot undo
        logits, hid = self._forward(prompt, 0, cache, layer_ids, last_only=True)
        assert hid is not None
        context.extend(hid)  # positions 0..len(prompt)-1
        tokens = [self._pick(logits, sampling, gen)]
        self._sync()
        prefill = time.perf_counter() - t0
        accepted: list[int] = []
        proposed: list[int] = []
        drafted = 0
        while not self._done(tokens, max_new_tokens):
            p = len(prompt) + len(tokens) - 1  # position of the anchor (last accepted token)
            proposal = self._propose(context, [*prompt, *tokens], sampling, gen, rule)
            k = int(proposal[0].numel())  # drafted tokens (the family's step decides)
            drafted = max(drafted, k)
            # a family with its own draft-length rule says what it would propose
            if (n_proposed := getattr(context, "proposed_length", None)) is not None:
                proposed.append(int(n_proposed))
            block = [tokens[-1], *proposal[0].tolist()]
            rollback.begin(len(block))
            logits, hid = self._forward(block, p, cache, layer_ids)  # [k+1, V], [k+1, n·H]
            assert hid is not None
            n, last = self._verify(block, logits, proposal, sampling, gen)
            accepted.append(n)
            # keep the anchor and the n accepted drafts, in every layer's state (with
            # n = k too: the crop trims what the forward recorded)
            rollback.undo(k - n)
            context.extend(hid[: n + 1])
            new = [*block[1 : n + 1], last]
            tokens.extend(new)
            if any(t in self.eos for t in new):
                break
        self._sync()
        tokens = self._clip(tokens, max_new_tokens)
        return DecodeResult(
            tokens, len(accepted), time.perf_counter() - t0, accepted, bs, prefill,
            drafted or bs - 1, proposed,
        )  # fmt: skip

    @staticmethod
    def _propose(
        context: DraftContext,
        seq: list[int],
        s: Sampling,
        gen: torch.Generator | None,
        rule: Rule,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens `[k]` from the family's drafting step (`context.propose`) and the
        q they were drawn from (None for argmax tokens: q is then the point mass the
        served rule verifies against)."""
        if s.greedy or rule == "served":
            tokens, rows = context.propose(seq, lambda row: int(row.argmax()))
            return torch.tensor(tokens, dtype=torch.long, device=rows.device), None
        assert gen is not None

        def draw(row: torch.Tensor) -> int:  # [V] -> one token drawn from q
            return int(sample(probabilities(row[None], s), gen)[0])

        tokens, rows = context.propose(seq, draw)
        d = torch.tensor(tokens, dtype=torch.long, device=rows.device)
        return d, probabilities(rows, s)  # q [k, V]

    @staticmethod
    def _verify(
        block: list[int],
        logits: torch.Tensor,
        proposal: tuple[torch.Tensor, torch.Tensor | None],
        s: Sampling,
        gen: torch.Generator | None,
    ) -> tuple[int, int]:
        """(drafts accepted, the token after them) for one verify forward's `logits`."""
        bs = len(block)
        if s.greedy:  # the argmax match; the token after them is the verifier's own
            y = logits.argmax(-1).tolist()
            n = 0
            while n < bs - 1 and block[n + 1] == y[n]:
                n += 1
            return n, y[n]
        assert gen is not None
        d, q = proposal
        p = probabilities(logits, s)  # [bs, V]
        return verify_block(p, one_hot(d, p.shape[1]) if q is None else q, d, gen)

    @torch.inference_mode()
    def tie(self, prefix: list[int], a: int, b: int) -> Tie:
        """The verifier's margin between tokens `a` and `b` as the next token after `prefix`
        (one uncached forward), against the rounding a changed summation order can cause:
        `TIE_ULPS` units of its dtype's epsilon, relative to the larger logit (at least 1).
        Where greedy and speculative outputs first differ (greedy chose `a`, speculative
        `b`), a margin within it is a tie the two forward shapes may break either way."""
        logits, _ = self._forward(prefix, 0, self._new_cache(), None, last_only=True)
        la, lb = float(logits[-1, a]), float(logits[-1, b])
        eps = torch.finfo(logits.dtype).eps
        tolerance = TIE_ULPS * eps * max(1.0, abs(la), abs(lb))
        return Tie(abs(la - lb), tolerance)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


__all__ = ["GREEDY", "TIE_ULPS", "DecodeResult", "Decoder", "Rule", "Tie", "first_mismatch"]
