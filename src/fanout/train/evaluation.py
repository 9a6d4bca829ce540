"""A trainer's `--eval-every`: real speculative decoding of the draft as it trains.

    scripts/train.py ... --eval-every 200 --eval-data heldout.jsonl   # eval_tau in the log

    evaluate = PeriodicEval(cfg, torch.device("cpu"))
    rec |= evaluate(draft)    # {"eval_tau", "eval_lossless", "eval_s"}

The acceptance length τ of the draft as it is now, decoded as its server decodes it
(fanout.decode.eval), and whether the output stayed lossless. The verifier and the
prompts are loaded at the first call and kept for the whole run.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fanout.model.draft import Draft
from fanout.train.config import TrainConfig


class PeriodicEval:
    """The eval session of one trainer, built at its first call."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.session: Any = None  # fanout.decode.eval.EvalSession

    def __call__(self, draft: Draft) -> dict[str, Any]:
        from fanout.decode.config import EvalConfig
        from fanout.decode.eval import EvalSession

        cfg = self.cfg
        t0 = time.perf_counter()
        if self.session is None:
            ecfg = EvalConfig(
                verifier_name_or_path=cfg.verifier_name_or_path,
                data=cfg.eval_data or "",
                tokenizer=cfg.eval_tokenizer or cfg.verifier_name_or_path,
                num_prompts=cfg.eval_prompts,
                max_new_tokens=cfg.eval_max_new_tokens,
                device=str(self.device),
            )
            self.session = EvalSession(ecfg, list(draft.cfg.target_layer_ids))
        draft.eval()
        try:
            rep = self.session.run({"draft": draft}, {"draft": None})
        finally:
            draft.train()
        d = rep["drafts"]["draft"]
        return {
            "eval_tau": d["acceptance_length"],
            "eval_lossless": rep["lossless"],
            "eval_s": round(time.perf_counter() - t0, 2),
        }
