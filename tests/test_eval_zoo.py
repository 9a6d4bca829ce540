"""`fanout eval`'s speculative decoder with every verifier of the zoo: lossless at T = 0,
rejected draft tokens undone in every layer's state.

.venv/bin/python -m pytest tests/test_eval_zoo.py -x -q

Architectures come from tests/verifier_zoo.py, ZOO and HYBRID_AND_SPARSE: sliding
windows and attention chunks of 8 tokens (prompts and decodes cross them), attention
sinks, MLA, linear attention with its convolution (Qwen3-Next, Qwen3.5), multimodal
checkpoints, Mamba-2 (Nemotron-H; beside attention in one layer: Falcon-H1), short
convolutions (LFM2) and DeepSeek-V3.2's indexer. Per architecture:
- the rollback itself (fanout.decode.rollback): after verify forwards whose last r
  tokens are undone, each next verify forward's logits equal a plain uncached forward
  over the whole sequence kept so far (the oracle: no cache at all);
- the decoder, greedy against speculative, token for token, with an untrained DFlash
  draft of the family registry (it proposes wrong tokens: nearly every step rejects
  every draft) and with a scripted draft that proposes the verifier's own greedy
  continuation right for 0..k slots in turn (every crop depth, full acceptance too).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fanout.decode.rollback import Rollback
from fanout.decode.spec_decode import Decoder, first_mismatch
from fanout.errors import ConfigError
from fanout.families.dflash.model import DFlashDraft
from fanout.model.draft_cache import IndependentSlots
from fanout.model.verifier import load_verifier
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)
from verifier_zoo import HYBRID_AND_SPARSE, VOCAB, ZOO, build

BLOCK = 5  # draft block: the anchor + 4 drafted tokens per verify step
LAYERS = [0, 1]  # the draft's target layers (every zoo model has at least 2)
NEW = 24  # new tokens per decode


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def _decoder(arch: str, root: Path) -> Decoder:
    path = build(arch, root / arch)
    v = load_verifier(path, device="cpu", capture_layer_ids=LAYERS, num_draft_layers=None)
    return Decoder(v, set())  # no EOS: every decode runs NEW tokens


def _draft(path: Path) -> DFlashDraft:
    """An untrained DFlash draft for the verifier (seeded); a multimodal checkpoint's
    text tensors are found by their names (fanout.model.verifier_dir.text_tensors)."""
    torch.manual_seed(0)
    return DFlashDraft.from_verifier(
        path, target_layer_ids=LAYERS, block_size=BLOCK, mask_token_id=VOCAB - 1
    )


class Scripted(IndependentSlots):
    """Proposes the verifier's greedy continuation `greedy` (after a prompt of
    `prompt_len`), right for `rights[i % len(rights)]` slots at verify step i and wrong
    after them, so step i must accept exactly that many."""

    def __init__(self, greedy: list[int], prompt_len: int, rights: list[int]) -> None:
        self.seq, self.p0, self.rights, self.step = greedy, prompt_len, rights, 0

    def extend(self, hidden: torch.Tensor) -> None:
        pass

    def logits(self, seq: list[int]) -> torch.Tensor:
        j = len(seq) - self.p0  # index in `greedy` of the token after the anchor
        right = self.rights[self.step % len(self.rights)]
        self.step += 1
        out = []
        for i in range(BLOCK - 1):
            t = self.seq[j + i] if j + i < len(self.seq) else 0
            out.append(t if i < right else (t + 1) % VOCAB)
        return torch.nn.functional.one_hot(torch.tensor(out), VOCAB).float()  # [k, V]


@pytest.mark.parametrize("arch", [*ZOO, *HYBRID_AND_SPARSE])
def test_zoo_speculative_decoding_is_lossless(arch: str, zoo_dir: Path) -> None:
    dec = _decoder(arch, zoo_dir)
    assert dec.verifier.num_layers >= len(LAYERS)

    # the rollback against the oracle: verify forwards of BLOCK tokens, the last r of
    # each undone; every verify forward's logits = an uncached forward of all so far
    seq = _ids(11, 0)  # past the window of 8: sliding layers have dropped keys already
    cache = dec._new_cache()
    dec._forward(seq, 0, cache, None, last_only=True)
    rollback = Rollback(cache, arch)
    for step, r in enumerate((4, 0, 2, 1, 3, 4)):
        block = _ids(BLOCK, 10 + step)
        rollback.begin(BLOCK)
        got, _ = dec._forward(block, len(seq), cache, None)  # [BLOCK, V]
        rollback.undo(r)
        want, _ = dec._forward([*seq, *block], 0, None, None)  # no cache at all
        scale = float(want.abs().max())
        assert torch.allclose(got, want[-BLOCK:], atol=1e-4 * scale, rtol=0), (
            arch, step, float((got - want[-BLOCK:]).abs().max()),
        )  # fmt: skip
        seq += block[: BLOCK - r]

    # the decoder: an untrained family draft (wrong tokens), then the scripted one
    draft = _draft(zoo_dir / arch)
    rejected = 0
    for n, seed in ((5, 1), (13, 2)):
        prompt = _ids(n, seed)
        g = dec.greedy(prompt, NEW)
        s = dec.speculative(prompt, draft, NEW)
        assert first_mismatch(g.tokens, s.tokens) is None, (arch, g.tokens, s.tokens)
        rejected += sum(BLOCK - 1 - a for a in s.accepted)
    assert rejected > 0  # rollback was exercised

    prompt = _ids(9, 3)
    g = dec.greedy(prompt, NEW)
    rights = [4, 0, 2, 1, 3]
    scripted = Scripted(g.tokens, len(prompt), rights)
    s = dec.speculative(prompt, draft, NEW, context=scripted)
    assert first_mismatch(g.tokens, s.tokens) is None, (arch, g.tokens, s.tokens)
    assert s.accepted[:-1] == (rights * NEW)[: len(s.accepted) - 1]  # the last: cut by NEW


def test_rollback_refuses_a_cache_layer_it_cannot_undo() -> None:
    from transformers.cache_utils import Cache, StaticLayer

    with pytest.raises(ConfigError, match=r"layer 0 \(StaticLayer"):
        Rollback(Cache(layers=[StaticLayer(max_cache_len=8)]), "verifier x")


def test_rollback_refuses_a_model_that_records_one_recurrent_state() -> None:
    """A linear-attention model that ignores `recurrent_states_to_keep` hands the cache
    only its last state: a crop would restore the wrong one, so undo refuses."""
    from transformers.cache_utils import Cache, LinearAttentionLayer

    layer = LinearAttentionLayer()
    rollback = Rollback(Cache(layers=[layer]), "verifier x")
    layer.update_conv_state(torch.zeros(1, 4, 6), conv_kernel_size=4)  # prefill
    layer.update_recurrent_state(torch.zeros(1, 2, 4, 4))
    rollback.begin(3)
    layer.update_conv_state(torch.zeros(1, 4, 3))  # the verify forward's 3 columns
    layer.update_recurrent_state(torch.ones(1, 2, 4, 4))  # one state, not 3
    with pytest.raises(ConfigError, match=r"recorded 1 recurrent states.*want 3"):
        rollback.undo(1)
