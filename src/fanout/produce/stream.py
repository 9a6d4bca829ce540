"""The stream: which dataset rows window w holds, for every epoch, reproducibly.

    from fanout.produce.stream import stream_rows
    idx, epoch = stream_rows(3, 16, 1000, 2, seed=0)   # dataset rows of window 3, its epoch

Row s of the endless stream is row perm_e[s mod N] of the prepared dataset,
e = s div N, perm_e a permutation seeded by (seed, e). Window w holds rows
[w·R, (w+1)·R) of that stream (the last one may be shorter;
fanout.store.streaminfo.window_span), so a recapture, or another producer replica,
reproduces it exactly.

Under `fanout produce --regenerate` the rows are regenerated chunk by chunk and
epoch 0 walks them in chunk order instead: fanout.produce.onpolicy.
"""

from __future__ import annotations

import numpy as np

from fanout.store.streaminfo import window_span


def stream_rows(
    window: int, window_rows: int, num_rows: int, epochs: int, seed: int
) -> tuple[np.ndarray, int]:
    """Dataset row indices of window `window` (int64 [<= window_rows]) and the epoch of its
    first row."""
    start, stop = window_span(window, window_rows, num_rows * epochs)
    s = np.arange(start, stop, dtype=np.int64)  # stream positions
    epochs_of = s // num_rows
    out = np.empty_like(s)
    for e in np.unique(epochs_of):
        perm = np.random.default_rng([seed, int(e)]).permutation(num_rows)
        sel = epochs_of == e
        out[sel] = perm[s[sel] % num_rows]
    return out, int(start // num_rows)
