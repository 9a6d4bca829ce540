"""An exponential moving average of a draft's weights: what a trainer that never ends saves.

    scripts/train.py ... --ema-decay 0.999      # checkpoints serve the averaged weights

    ema = WeightEMA(draft, decay=0.999)
    ...; opt.step(); ema.update(draft)          # after every optimizer step
    ema.serving(draft.trainable_state())        # the weights model.safetensors holds
    ema.tensors()                               # {"ema.<name>": tensor}: the resume file

A trainer on an open-ended stream (`fanout produce --follow`) has no schedule that
decays to 0 at a known end, so the last step's weights carry the last batches' noise;
the average over the recent steps is the usual remedy (timm, torchtitan's model
averaging) and is what a promoted draft should be (`fanout promote` compares
checkpoints). Only trained parameters are averaged (the verifier's frozen tensors are
served as they are). The decay ramps up as min(decay, (1 + n) / (10 + n)) over the
first updates, so early averages are not dominated by the random initialisation.
The raw weights and the optimizer still resume training exactly; the average is
resumed from the checkpoint's resume file (fanout.checkpoints.resume).
"""

from __future__ import annotations

import torch

PREFIX = "ema."


class WeightEMA:
    """The averaged copies of a draft's trained parameters (fp32, on their device)."""

    def __init__(self, draft: torch.nn.Module, decay: float) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.reset(draft)

    def reset(self, draft: torch.nn.Module) -> None:
        """Start the average over at the draft's current weights."""
        self.updates = 0
        self.avg = {
            name: p.detach().float().clone()
            for name, p in draft.named_parameters()
            if p.requires_grad
        }

    @torch.no_grad()
    def update(self, draft: torch.nn.Module) -> None:
        """Move the average toward the draft's current weights (after an optimizer step)."""
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        params = dict(draft.named_parameters())
        names = list(self.avg)
        torch._foreach_lerp_(
            [self.avg[n] for n in names], [params[n].detach().float() for n in names], 1 - d
        )
        self.updates += 1

    def serving(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`weights` (a draft's trainable_state) with the averaged ones in place."""
        return {k: self.avg[k].to(v.dtype) if k in self.avg else v for k, v in weights.items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """What the resume file keeps: the averages and how many updates made them."""
        out = {PREFIX + k: v.detach().cpu().contiguous() for k, v in self.avg.items()}
        out[PREFIX + "updates"] = torch.tensor(self.updates, dtype=torch.int64)
        return out

    def load(self, saved: dict[str, torch.Tensor]) -> bool:
        """Restore from a resume file's tensors; False when it holds no average (a
        checkpoint written without --ema-decay: the average restarts from the weights)."""
        if PREFIX + "updates" not in saved:
            return False
        for k in self.avg:
            self.avg[k].copy_(saved[PREFIX + k])
        self.updates = int(saved[PREFIX + "updates"])
        return True
