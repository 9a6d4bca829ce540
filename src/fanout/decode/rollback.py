"""Undoing rejected draft tokens in every layer of the verifier's cache.

    from fanout.decode.rollback import Rollback
    rollback = Rollback(cache, "verifier models/qwen3.5")  # refuses a layer it cannot undo
    model(prompt, cache=cache)                        # prefill: nothing recorded
    rollback.begin(len(block))                        # before each verify forward
    model(block, cache=cache)                         # anchor + drafted tokens
    rollback.undo(rejected)                           # the last `rejected` tokens, every layer

A verify forward runs the anchor and k drafted tokens on top of the cache; with n
accepted, the last k - n tokens must leave every layer's state as if they had never
run. What that takes depends on the layer's cache (transformers' `DynamicCache` holds
one layer object per decoder layer, chosen from `config.layer_types`):

| cache layer | layer types | what a rejected token left behind | undone by |
|---|---|---|---|
| `DynamicLayer` | full attention, MLA | its key / value | crop: drop the last k - n |
| `DynamicIndexedLayer` | MLA with an indexer (DeepSeek-V3.2) | its key / value and indexer key | crop: drop the last k - n of both |
| `DynamicSlidingWindowLayer` | sliding, chunked attention | its key / value, and it pushed the oldest keys out of the window | recording, then crop |
| `LinearAttentionLayer` | gated delta rule (Qwen3-Next, Qwen3.5), Mamba-2 (Nemotron-H) | the recurrent state and the convolution window moved past it | recording, then crop |
| `LinearAttentionLayer`, conv state only | short convolution (LFM2) | the convolution window moved past it | recording, then crop |
| `LinearAttentionAndFullAttentionLayer` | attention and Mamba-2 in one layer (Falcon-H1) | both of the above | recording, then crop |
| `DummyLayer` | KV-sharing, MLP- and MoE-only blocks (Nemotron-H) | nothing | nothing |

"Recording" is transformers' own mechanism for assisted generation
(`activate_past_recording(recurrent_states_to_keep=W)`, then `crop(-r)`), chosen over
a snapshot of the state with a re-run of the accepted prefix because it is exact and
costs no extra forward: a sliding layer keeps the keys it would have dropped until the
crop; a linear-attention layer keeps its whole convolution input until the crop, and
runs the last W tokens of a forward one recurrent step at a time, handing the cache the
state after each of them; `crop(-r)` puts back the state after the kept tokens. The
restored state is the one the verify forward itself computed, token by token — the
same recurrent steps plain decoding takes. Recording starts after the prefill (the
prompt is never recorded) and W is set to the whole verify width at every step: with
W = k (as transformers' assisted generation sets it) the state after the anchor alone
is not recorded and rejecting every draft would restore the state from before the
anchor. Cost: W recurrent states per linear-attention layer between the forward and
the crop (freed by it), and the verify's linear-attention layers run one token at a
time instead of in chunks.

Two checks keep a model that does not honour recording from being decoded silently
wrong: a layer type outside the table is refused at construction (one line naming it),
and after every verify forward each recording linear-attention layer must hold W
recurrent states and W more convolution columns (a model that ignored
`recurrent_states_to_keep` would leave one, and the crop would restore the wrong one).
"""

from __future__ import annotations

from typing import Any

from fanout.errors import ConfigError


def _kind(layer: Any) -> str:
    """How rejected tokens are undone in one cache layer: "crop" (cutting the keys is
    exact), "record" (recording, then crop), "none" (no state), or "" (not known)."""
    from transformers import cache_utils as cu

    if isinstance(layer, getattr(cu, "DummyLayer", ())):
        return "none"
    if hasattr(layer, "activate_past_recording"):
        return "record"  # sliding windows, linear attention, hybrids
    if isinstance(layer, cu.DynamicLayer) and not getattr(layer, "is_sliding", False):
        return "crop"  # full attention (and its indexed variant): one key per token
    return ""


class Rollback:
    """Undoes rejected draft tokens in every layer of one `DynamicCache` (module
    docstring). `where` names the verifier in errors."""

    def __init__(self, cache: Any, where: str) -> None:
        self.cache = cache
        self.where = where
        self.kinds = [_kind(layer) for layer in cache.layers]
        bad = [(i, type(layer).__name__) for i, (layer, k) in
               enumerate(zip(cache.layers, self.kinds)) if not k]  # fmt: skip
        if bad:
            i, name = bad[0]
            raise ConfigError(
                f"{where}: cannot undo rejected draft tokens in layer {i} ({name}, "
                f"{len(bad)} layer(s) like it) with this transformers version; speculative "
                "decoding with it would not be lossless"
            )
        self._width = 0
        self._conv_before: dict[tuple[int, int], int] = {}

    def _recording(self) -> list[tuple[int, Any]]:
        return [(i, x) for i, (x, k) in enumerate(zip(self.cache.layers, self.kinds))
                if k == "record"]  # fmt: skip

    def begin(self, width: int) -> None:
        """Before a verify forward of `width` tokens (anchor + drafts): record every state
        a crop of up to width - 1 of them needs."""
        self._width = width
        self._conv_before = {}
        for i, layer in self._recording():
            # sets recurrent_states_to_keep = width and starts an empty history (it is
            # empty anyway after the last crop); sliding layers ignore the count
            layer.activate_past_recording(recurrent_states_to_keep=width)
            for s, conv in _states(layer, "conv_states"):
                self._conv_before[(i, s)] = int(conv.shape[-1])

    def undo(self, rejected: int) -> None:
        """After the verify forward: drop its last `rejected` tokens from every layer (0:
        still trims the recorded states back to what the next forward needs)."""
        self._check()
        # a negative count means "remove this many" in every transformers version with crop
        self.cache.crop(-rejected)

    def _check(self) -> None:
        """Every recording linear-attention layer kept what the crop will restore from."""
        w = self._width
        for i, layer in self._recording():
            for s, hist in _states(layer, "recurrent_states_history"):
                if layer.is_recurrent_states_initialized.get(s) and len(hist) != w:
                    raise ConfigError(
                        f"{self.where}: layer {i} ({type(layer).__name__}) recorded "
                        f"{len(hist)} recurrent states for a verify forward of {w} tokens "
                        f"(want {w}); its model does not honour recurrent_states_to_keep, "
                        "so rejected draft tokens cannot be undone exactly"
                    )
            for s, conv in _states(layer, "conv_states"):
                before = self._conv_before.get((i, s))
                if before is not None and int(conv.shape[-1]) != before + w:
                    raise ConfigError(
                        f"{self.where}: layer {i} ({type(layer).__name__}) kept "
                        f"{int(conv.shape[-1]) - before} convolution columns for a verify "
                        f"forward of {w} tokens; rejected draft tokens cannot be undone "
                        "exactly"
                    )


def _states(layer: Any, name: str) -> list[tuple[int, Any]]:
    """(state index, value) of a linear-attention layer's per-state dict `name`, those
    set; [] for a layer without it (attention-only sliding layers)."""
    d = getattr(layer, name, None)
    if not isinstance(d, dict):
        return []
    return [(s, v) for s, v in d.items() if v is not None]


__all__ = ["Rollback"]
