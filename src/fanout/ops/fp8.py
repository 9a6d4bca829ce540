"""fp8 (e4m3) storage of hidden states with one scale per token and captured layer.

    from fanout.ops.fp8 import quantize_into, dequantize
    quantize_into(x, q_j, scale_j)          # layer j: x [B, T, H] → q_j [B, T, H] fp8 + scale_j [B, T]
    hidden = dequantize(q, scale)           # k layers side by side: [B, T, k·H] + [B, T, k] → float32

`fanout produce --storage-dtype float8_e4m3fn` halves what windows cost against bf16
(disk, page cache, publish bandwidth: n·H bytes per token plus 4·n for the scales).
Each captured layer's output is scaled per token so that its largest |value| maps to
448, e4m3's largest finite value, and rounded to nearest: the relative error of an
element is at most 2⁻⁴ (3 mantissa bits) down to 2⁻⁶/448 ≈ 3.5e-5 of the token's
largest value (e4m3's smallest normal), and at most 2⁻¹⁰·scale in absolute terms
below that. Per token, not per tensor, because LLM hidden states have tokens
whose norms differ by orders of magnitude (the first token's "attention sink" above
all), and per layer because layers do too. `last_hidden_states` stays bf16.

Windows store each captured layer's values and scales as their own tensors
(`hidden_states.<layer>` `[R, T, H]` F8_E4M3, `hidden_states_scale.<layer>` `[R, T]`
F32; fanout.store.windowfile), so a trainer that reads k of the captured layers reads
only their values and scales. The consumer puts the k layers side by side in the
draft's order (`[B, T, k·H]` and `[B, T, k]`), the layout `dequantize` takes.

Trainers see float32 `hidden_states` either way (`dequantize` in the trainer, on
its device); fp8 changes what the draft trains on by that rounding, so compare a
run's EAL against a bf16 run before relying on it.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_TINY = torch.finfo(torch.float32).tiny  # scale floor: an all-zero token stays zero


def quantize_into(x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """Quantise x [..., H] per row into q_out [..., H] (fp8) and scale_out [...] (float32).

    q_out and scale_out may be strided views (e.g. a layer's slice of a wider buffer).
    """
    xf = x.float()  # [..., H]
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_(min=_TINY)  # [...]
    # clamp: torch saturates on conversion today, older releases gave NaN past 448
    q_out.copy_((xf / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8))
    scale_out.copy_(scale)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., n·H] fp8 and scale [..., n] → float32 [..., n·H] (layer j uses scale[..., j])."""
    n = scale.shape[-1]
    if q.shape[:-1] != scale.shape[:-1] or q.shape[-1] % n:
        raise ValueError(
            f"fp8 hidden states {tuple(q.shape)} do not match scales {tuple(scale.shape)}"
        )
    grouped = q.float().unflatten(-1, (n, q.shape[-1] // n))  # [..., n, H]
    return (grouped * scale.float()[..., None]).flatten(-2)  # [..., n·H]
