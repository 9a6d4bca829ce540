"""Sampling rules of speculative decoding at T > 0: processed distributions, acceptance.

    from fanout.model.sampling import Sampling, probabilities, verify_block
    s = Sampling(temperature=1.0, top_p=0.95, top_k=50)
    p = probabilities(verifier_logits, s)         # [bs, V] the verifier's processed p
    n, token = verify_block(p, q, d, gen)         # drafts accepted, token appended after

Two rules, both lossless in distribution (every appended token is distributed as plain
sampling from p given the tokens before it):

- **served** (`q` = one-hot at the draft's argmax `d`): what vLLM's EAGLE/DFlash
  proposers and the DFlash authors' loop do — the draft proposes its greedy tokens and
  passes no probabilities; `d` is accepted with probability p(d) and on rejection the
  token is drawn from p with d removed (renormalised). The τ this gives is the one an
  engine sees.
- **sampled draft** (Leviathan et al. 2023; Chen et al. 2023): `d ~ q`, accepted with
  probability min(1, p(d)/q(d)); on rejection the token is drawn from
  normalize(max(0, p − q)). Reported beside the served rule, never instead.

After a full accept the bonus token is drawn from p at the last slot. Top-k/top-p act
on the temperature-scaled logits before the rule (on p and on q alike); a reduced draft
vocabulary is mapped to verifier ids before (probability 0 outside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Logit processing of one temperature. `temperature` 0 means greedy (no sampling)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """`[N, V]` logits -> `[N, V]` float32 probabilities after temperature, top-k, top-p
    (top-p keeps the smallest prefix of the sorted distribution whose mass reaches
    `top_p`, always at least the most likely token — vLLM's and HF's rule)."""
    x = logits.float() / s.temperature  # [N, V]
    if 0 < s.top_k < x.shape[-1]:
        kth = x.topk(s.top_k, dim=-1).values[:, -1:]  # [N, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        srt, idx = x.sort(dim=-1, descending=True)  # [N, V]
        ps = srt.softmax(-1)
        drop = ps.cumsum(-1) - ps >= s.top_p  # mass before this token already reached
        x = x.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def accept_probability(pd: torch.Tensor, qd: torch.Tensor) -> torch.Tensor:
    """min(1, p(d)/q(d)) for drafted tokens d with q(d) > 0: `[N]`."""
    return (pd / qd.clamp_min(1e-30)).clamp(max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p − q)) `[N, V]` (unnormalised; rows that are all zero — p = q,
    where rejection cannot happen — fall back to p so that sampling stays defined)."""
    r = (p - q).clamp_min(0)
    empty = r.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p, r)


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor, d: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot's rule for N independent slots: p, q `[N, V]`, d `[N]` drafted tokens.
    Returns (accepted `[N]` bool, the token each slot emits `[N]`: d when accepted, else a
    draw from the residual). Draws a fixed amount of randomness (reproducible by seed)."""
    pd = p.gather(1, d[:, None])[:, 0]
    qd = q.gather(1, d[:, None])[:, 0]
    u = torch.rand(d.shape[0], generator=gen, device=p.device)
    ok = u < accept_probability(pd, qd)
    other = torch.multinomial(residual(p, q), 1, generator=gen)[:, 0]
    return ok, torch.where(ok, d, other)


def verify_block(
    p: torch.Tensor, q: torch.Tensor, d: torch.Tensor, gen: torch.Generator
) -> tuple[int, int]:
    """A verify step: p `[bs, V]` (slot k's distribution of the token after block slot
    k), q `[bs-1, V]`, d `[bs-1]`. Returns (n drafts accepted, the token appended after
    them: the first rejection's residual draw, or after a full accept the bonus ~ p[-1])."""
    m = d.shape[0]
    ok, tok = accept_or_resample(p[:m], q, d, gen)
    bonus = int(torch.multinomial(p[m:], 1, generator=gen)[0, 0])
    rejected = (~ok).nonzero()
    if rejected.numel() == 0:
        return m, bonus
    n = int(rejected[0, 0])
    return n, int(tok[n])


def one_hot(d: torch.Tensor, vocab: int) -> torch.Tensor:
    """q of the served rule: the draft's argmax tokens as point masses `[N, V]`."""
    return torch.nn.functional.one_hot(d, vocab).float()


def sample(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draw per row of `[N, V]` probabilities: `[N]`."""
    return torch.multinomial(p, 1, generator=gen)[:, 0]


__all__ = [
    "Sampling",
    "accept_or_resample",
    "accept_probability",
    "one_hot",
    "probabilities",
    "residual",
    "sample",
    "verify_block",
]
