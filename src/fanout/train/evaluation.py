"""A trainer's `--eval-every`: real speculative decoding of the draft as it trains.

    scripts/train.py ... --eval-every 200 --eval-data heldout.jsonl   # eval_tau in the log

    evaluate = PeriodicEval(cfg, torch.device("cpu"))
    rec |= evaluate(draft)    # {"eval_tau", "eval_lossless", "eval_s"}

The acceptance length τ of the draft as it is now, decoded as its server decodes it
(fanout.decode.eval), and whether the output stayed lossless. The verifier and the
prompts are loaded at the first call and kept until the verifier changes.

A verifier that changes (#52: a versioned --verifier-name-or-path, the trainer's
`VersionFollower`): each eval decodes with the version whose embedding, head and norm the
draft trains with now (`follower.path`), not the one the trainer started from; the session
is rebuilt when that version moved since the last eval, and the record names it
(`eval_verifier_version`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fanout.model.draft import Draft
from fanout.train.config import TrainConfig
from fanout.train.verifier_versions import VersionFollower


class PeriodicEval:
    """The eval session of one trainer, built at its first call (and again each time
    `follower`'s verifier version moved since the last one)."""

    def __init__(
        self, cfg: TrainConfig, device: torch.device, follower: VersionFollower | None = None
    ) -> None:
        self.cfg, self.device, self.follower = cfg, device, follower
        self.session: Any = None  # fanout.decode.eval.EvalSession
        self.verifier = ""  # the directory the session's verifier was loaded from

    def __call__(self, draft: Draft) -> dict[str, Any]:
        from fanout.decode.config import EvalConfig
        from fanout.decode.eval import EvalSession

        cfg, f = self.cfg, self.follower
        # the version the draft's frozen tensors are from now: the verifier it drafts for
        verifier = str(f.path) if f is not None else cfg.verifier_name_or_path
        t0 = time.perf_counter()
        if self.session is None or verifier != self.verifier:
            self.session = None  # the old version's verifier freed before the new loads
            ecfg = EvalConfig(
                verifier_name_or_path=verifier,
                data=cfg.eval_data or "",
                tokenizer=cfg.eval_tokenizer or verifier,
                num_prompts=cfg.eval_prompts,
                max_new_tokens=cfg.eval_max_new_tokens,
                device=str(self.device),
            )
            self.session = EvalSession(ecfg, list(draft.cfg.target_layer_ids))
            self.verifier = verifier
        draft.eval()
        try:
            rep = self.session.run({"draft": draft}, {"draft": None})
        finally:
            draft.train()
        d = rep["drafts"]["draft"]
        out = {
            "eval_tau": d["acceptance_length"],
            "eval_lossless": rep["lossless"],
            "eval_s": round(time.perf_counter() - t0, 2),
        }
        return out if f is None else out | {"eval_verifier_version": f.loaded}
