"""row_argmax against torch.argmax on random inputs: ties, NaN, ragged tails, dtypes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fanout.ops.argmax import row_argmax


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 700),
    block=st.sampled_from([4, 16, 64, 128]),
    levels=st.sampled_from([0, 3, 1000]),  # 0: continuous values; else few values (ties)
    nans=st.integers(0, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_row_argmax_equals_argmax(
    rows: int, cols: int, block: int, levels: int, nans: int, dtype: torch.dtype, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    if levels:
        x = torch.randint(0, levels, (rows, cols), generator=g).to(dtype)
    else:
        x = torch.randn(rows, cols, generator=g).to(dtype)
    for _ in range(nans):
        r, c = torch.randint(0, rows, (1,), generator=g), torch.randint(0, cols, (1,), generator=g)
        x[r, c] = float("nan")
    got = row_argmax(x, block=block)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1)), (x, got, x.argmax(dim=-1))


def test_row_argmax_at_vocab_size_with_the_maximum_in_the_ragged_tail() -> None:
    x = torch.randn(5, 151_669)
    x[2, 151_668] = 100.0  # beyond the last full 2048-block
    x[4, 0] = x[4, 151_660] = 50.0  # tie across first block and tail: first wins
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert row_argmax(x)[2] == 151_668 and row_argmax(x)[4] == 0


def test_row_argmax_takes_non_contiguous_rows_and_rejects_other_ranks() -> None:
    x = torch.randn(6, 5000)[::2]  # row stride 10000
    assert torch.equal(row_argmax(x, block=256), x.argmax(dim=-1))
    with pytest.raises(ValueError, match="rows, columns"):
        row_argmax(torch.randn(2, 3, 4))
