"""The names of a window's per-row tensors: one spelling for every stage that makes or reads them.

    from fanout.rows import INPUT_IDS, TARGET_IDS
    ids, labels = batch[INPUT_IDS], batch[TARGET_IDS]       # [B, T] each

The window format (fanout.store.windowfile) owns this vocabulary: a window file holds
these tensors, one row per packed row of the stream. It lives in the core layer so that
the stages below the store spell the names the same way: data packing makes the token
rows (`PACKED_ROW`), the producer's capture adds the verifier's tensors, the consumer
reads `ROW_TENSORS` plus its layers, and every draft family reads them from a batch.
Per-layer hidden states are `hidden_states.<layer>` in a file
(`fanout.store.windowfile.hidden_name`); in a batch, `HIDDEN_STATES` is the consumer's
layers side by side.
"""

INPUT_IDS = "input_ids"  # [R, T] int32: the packed tokens (padding: the pad id)
LOSS_MASK = "loss_mask"  # [R, T] uint8: 1 where the token is supervised (assistant)
DOCUMENT_IDS = "document_ids"  # [R, T] int32: the document of each position, -1 on padding
POSITION_IDS = "position_ids"  # [R, T] int32: the position within its document
TARGET_IDS = "target_ids"  # [R, T] int32: the verifier's greedy prediction of token t+1
# [R, T, H]: the verifier's last (normed) states, times its logit scale where it has one
# (Falcon-H1): its logits are last_hidden_states · Wᵀ (fanout.model.verifier_dir)
LAST_HIDDEN_STATES = "last_hidden_states"
HIDDEN_STATES = "hidden_states"  # file: `hidden_states.<layer>` [R, T, H]; batch: [B, T, k·H]
HIDDEN_STATES_SCALE = "hidden_states_scale"  # fp8 scales: `.<layer>` [R, T]; batch [B, T, k]

PACKED_ROW = (INPUT_IDS, LOSS_MASK, DOCUMENT_IDS, POSITION_IDS)  # what packing makes
ROW_TENSORS = (TARGET_IDS, *PACKED_ROW)  # what every window holds beside the hidden states
