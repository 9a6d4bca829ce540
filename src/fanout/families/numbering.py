"""The layer numbering where fanout's and the serving side's conventions meet, and the
speculators release the checkpoint layout matches: below every family and the shared
checkpoint code (fanout.checkpoints applies them).

    from fanout.families.numbering import to_serving_layer_ids
    to_serving_layer_ids([1, 9, 17])   # [2, 10, 18]
"""

from __future__ import annotations

from fanout.errors import CheckpointError

# The speculators release whose DFlash config this layout matches (tests/test_speculators.py
# loads our checkpoints with it when it is installed).
SPECULATORS_VERSION = "0.9.0"


# ---- layer numbering: where fanout's and the serving side's conventions meet ----------
#
# fanout (z-lab / SpecForge numbering): target layer i is the *output of decoder layer i*
#   (0-based), i.e. HF `output_hidden_states` entry `hidden_states[i + 1]`.
# speculators / vLLM: `aux_hidden_state_layer_ids` are indices into HF `hidden_states`
#   (entry 0 = embeddings); vLLM subtracts 1 when it wires the decoder layers.
# These two functions are the only place the +1 happens; every writer and reader of a
# checkpoint's `aux_hidden_state_layer_ids` goes through them. The list is ascending
# (fanout.contract.ascending_layer_ids): engines feed the layers in that order whatever
# order it lists, so check_format refuses any other and upgrade_checkpoint permutes fc.


def to_serving_layer_ids(target_layer_ids: list[int] | tuple[int, ...]) -> list[int]:
    """fanout decoder-layer ids -> speculators/vLLM `aux_hidden_state_layer_ids`.

    >>> to_serving_layer_ids([1, 9, 17])
    [2, 10, 18]
    """
    return [int(i) + 1 for i in target_layer_ids]


def from_serving_layer_ids(aux_hidden_state_layer_ids: list[int]) -> list[int]:
    """speculators/vLLM `aux_hidden_state_layer_ids` -> fanout decoder-layer ids.
    Entry 0 (the embeddings) is no decoder layer's output: refused."""
    if any(int(j) < 1 for j in aux_hidden_state_layer_ids):
        raise CheckpointError(
            f"aux_hidden_state_layer_ids {aux_hidden_state_layer_ids}: 0 is the embedding "
            "output, which no fanout capture provides"
        )
    return [int(j) - 1 for j in aux_hidden_state_layer_ids]


__all__ = ["SPECULATORS_VERSION", "from_serving_layer_ids", "to_serving_layer_ids"]
