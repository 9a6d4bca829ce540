"""The producer's capture side: one window's rows through the verifier into host buffers.

    capturer = WindowCapturer(verifier, dataset, batch_rows=4)
    window = capturer.capture(idx)      # rows `idx` of the prepared dataset, in window order
    window.wait()                       # CUDA copies are asynchronous: wait before reading
    window.check()                      # CaptureCheckFailed: not to be published
    publish(window.tensors)
    capturer.flip()                     # the next capture fills the other buffer slot

Buffers: every tensor a window needs lives in a host buffer reused window after
window, in two slots so a window can be published from one while the next is
captured into the other (`fanout.produce.producer` flips them only when it overlaps
publishing). Hidden states get one `[R, T, H]` buffer per captured layer, since
windows store one tensor per layer (`hidden_states.<layer>`, fanout.store.windowfile).
A fresh tensor per window would be page-faulted in on every copy (slow, above all under gVisor), and device→host copies run faster into
pinned memory: together ~1.8× the capture cost on an H200 (benchmarks/producer.py).

Copies: on CUDA each batch's outputs are copied on a side stream into the pinned
buffer, without the host waiting (see `_HostCopier`); on CPU the verifier's hooks
write straight into the buffer, so there is no copy of the hidden states at all.

Check: each batch also yields 3 floats per token and captured layer (min, max, sum:
`Capture.layer_stats`), gathered per window beside the tensors (not published);
`CapturedWindow.check()` reads them once the copies landed (fanout.produce.capture_check).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fanout.data.cache import PackedDataset
from fanout.model.verifier import Capture, Verifier
from fanout.ops.fp8 import FP8
from fanout.produce.capture_check import check_window
from fanout.rows import (
    DOCUMENT_IDS,
    INPUT_IDS,
    LAST_HIDDEN_STATES,
    LOSS_MASK,
    POSITION_IDS,
    TARGET_IDS,
)
from fanout.store.windowfile import hidden_name, scale_name


@dataclass(frozen=True, slots=True)
class CapturedWindow:
    """One window's tensors on the host, once `wait()` returned (CUDA copies are async)."""

    tensors: dict[str, Any]
    wait: Callable[[], None]
    # after `wait`: CaptureCheckFailed naming the layer and row if the window is bad
    check: Callable[[], None] = lambda: None


class _HostCopier:
    """Device→host copies of one window's batches, queued on a side CUDA stream.

    Why a side stream: copies on the compute stream would serialise with the next
    batch's forward, and blocking copies would make the host wait for the GPU once
    per batch and then refill its queue from empty. Here each batch's copies wait (on
    the device, not the host) for the forward that produced them, run on the copy
    engine while the next forward computes, and `record_stream` keeps the caching
    allocator from reusing a source's memory before the copy has read it.
    Without a stream (CPU) a copy is a plain `copy_`.
    """

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (host dst, src) pair of one batch."""
        if self._stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        self._stream.wait_stream(torch.cuda.current_stream(pairs[0][1].device))
        with torch.cuda.stream(self._stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)  # dst is pinned (WindowCapturer._buffer)
        for _, src in pairs:
            src.record_stream(self._stream)

    def done(self) -> Callable[[], None]:
        """A callable that blocks until every copy queued so far has landed."""
        if self._stream is None:
            return _nothing
        event = torch.cuda.Event()
        event.record(self._stream)
        return event.synchronize


def _nothing() -> None:
    return None


class WindowCapturer:
    """Captures windows of a prepared dataset with one verifier (see the module doc)."""

    def __init__(
        self,
        verifier: Verifier,
        dataset: PackedDataset,
        batch_rows: int,
        forward: Callable[..., Capture] | None = None,
    ) -> None:
        self.verifier = verifier
        self.dataset = dataset
        self.batch_rows = batch_rows
        # `Verifier.capture`, or under --tp the leader's (fanout.produce.tp_capture), which has
        # every rank run the same forward
        self._forward = forward or verifier.capture
        self._bufs: dict[str, torch.Tensor] = {}
        self._slot = 0
        dev = verifier.device
        self._copier = _HostCopier(torch.cuda.Stream(dev) if dev.type == "cuda" else None)

    def use(self, verifier: Verifier) -> None:
        """Capture with `verifier` from the next window on (--follow-verifier loads a new
        version between windows; it has the old one's shapes, so the buffers stay)."""
        self.verifier, self._forward = verifier, verifier.capture

    def flip(self) -> None:
        """Capture into the other buffer slot from now on (one window is being published)."""
        self._slot ^= 1

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This slot's host buffer `name`, at least `shape`; valid until its slot is reused."""
        key = f"{name}.{self._slot}"
        buf = self._bufs.get(key)
        if buf is None or buf.shape[1:] != shape[1:] or buf.shape[0] < shape[0]:
            pin = self.verifier.device.type == "cuda"
            buf = torch.empty(shape, dtype=dtype, pin_memory=pin)
            self._bufs[key] = buf
        return buf[: shape[0]]  # the last window may be partial; still contiguous

    def _stats_buffer(self, n: int, r: int, t: int) -> torch.Tensor:
        """This slot's [n, R, T, 3] float32 host buffer of `Capture.layer_stats` (layers
        first, as the verifier writes them; reallocated for a partial last window)."""
        key = f"capture_stats.{self._slot}"
        buf = self._bufs.get(key)
        if buf is None or tuple(buf.shape) != (n, r, t, 3):
            pin = self.verifier.device.type == "cuda"
            buf = torch.empty((n, r, t, 3), dtype=torch.float32, pin_memory=pin)
            self._bufs[key] = buf
        return buf

    def capture(self, idx: np.ndarray) -> CapturedWindow:
        """Rows `idx` of the dataset through the verifier: the window's tensors (host).

        On CUDA the device→host copies are only *queued* here, so the next batch's
        forward overlaps them and the host never waits per batch;
        `CapturedWindow.wait()` blocks until they have landed.
        """
        v = self.verifier
        rows = self.dataset.rows(idx)  # dict of [R, T] numpy arrays
        r, t = rows[INPUT_IDS].shape
        layers, h = v.capture_layer_ids, v.hidden_size
        sdt = v.storage_dtype
        fp8 = sdt == FP8
        hidden = [self._buffer(hidden_name(i), (r, t, h), sdt) for i in layers]  # n × [R, T, H]
        target = self._buffer(TARGET_IDS, (r, t), torch.int32)  # [R, T]
        scales = (
            [self._buffer(scale_name(i), (r, t), torch.float32) for i in layers] if fp8 else None
        )  # n × [R, T]
        stats = self._stats_buffer(len(layers), r, t)  # [n, R, T, 3]
        last = None
        if v.config.store_last_hidden_states:
            last = self._buffer("last", (r, t, h), v.last_hidden_dtype)  # [R, T, H]
        as_t = {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in rows.items()}
        on_cpu = v.device.type == "cpu"
        b = self.batch_rows
        for s in range(0, r, b):
            sl = slice(s, s + b)
            cap = self._forward(
                as_t[INPUT_IDS][sl],
                as_t[POSITION_IDS][sl],
                as_t[DOCUMENT_IDS][sl],
                # On CPU the hooks write straight into the window buffers: no copy at all.
                hidden_out=[x[sl] for x in hidden] if on_cpu else None,
                scale_out=[x[sl] for x in scales] if on_cpu and scales is not None else None,
                stats_out=stats[:, sl] if on_cpu else None,
            )
            pairs = [(target[sl], cap.target_ids)]
            if not on_cpu and cap.layer_stats is not None:
                pairs.append((stats[:, sl], cap.layer_stats))
            if not on_cpu:
                pairs += [(x[sl], y) for x, y in zip(hidden, cap.layers, strict=True)]
                if scales is not None and cap.layer_scales is not None:
                    pairs += [(x[sl], y) for x, y in zip(scales, cap.layer_scales, strict=True)]
            if last is not None and cap.last_hidden_states is not None:
                pairs.append((last[sl], cap.last_hidden_states))
            self._copier.copy(pairs)
        tensors: dict[str, Any] = {
            **{hidden_name(i): x for i, x in zip(layers, hidden, strict=True)},
            TARGET_IDS: target,
            INPUT_IDS: as_t[INPUT_IDS].to(torch.int32),
            LOSS_MASK: as_t[LOSS_MASK].to(torch.uint8),
            DOCUMENT_IDS: as_t[DOCUMENT_IDS].to(torch.int32),
            POSITION_IDS: as_t[POSITION_IDS].to(torch.int32),
        }
        if scales is not None:
            tensors |= {scale_name(i): x for i, x in zip(layers, scales, strict=True)}
        if last is not None:
            tensors[LAST_HIDDEN_STATES] = last
        docs = tensors[DOCUMENT_IDS]
        return CapturedWindow(
            tensors,
            self._copier.done(),
            lambda: check_window(stats, docs, target, layers),
        )
