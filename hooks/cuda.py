"""Collectives on CUDA tensors: completion and timing from two CUDA events around each (queueing,
then execution), and the NaN/Inf check's sum on the device, never synchronising the host: the
sidecar's thread ``poll()``s the events. Bounded by ``POOL``; past it the op is timed on the CPU
(or goes unchecked) and counted (``gpu_pool_exhausted``). See docs/gpu.md.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

import torch

from . import process_ring
from .futures import when_done
from .ring import NAN_HAS_INF, NAN_HAS_NAN

POOL = 4096


class GpuTracker:
    def __init__(self, pool: int = POOL):
        self.pool = pool
        self._free: collections.deque = collections.deque()
        self._created = 0
        self._timed: collections.deque = collections.deque()
        """(start, end, complete) of collectives in flight on the GPU, in issue order."""
        self._checks: collections.deque = collections.deque()
        """(event, slot, report) of NaN checks whose sums are on their way to the host."""
        self._slots: list[torch.Tensor] = []
        """Pinned host memory, one float32 each: where the sums land."""
        self._free_slots: collections.deque = collections.deque()
        self._free_marks: collections.deque = collections.deque()
        self._streams: dict[tuple, Any] = {}
        self._references: dict[int, tuple[Any, int]] = {}
        self._side: dict[int, Any] = {}

    # -- the training thread ------------------------------------------------------------------------

    def start(self, device: torch.device) -> tuple | None:
        """Record ``start`` on the current stream; None when the pool is empty (the op is timed on the CPU)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        pair = self._take(index)
        if pair is not None:
            _record(pair[0], self._current(index))
        return pair

    def end(self, pair: tuple, future: Any, complete: Callable[[int, int], None],
            failed: Callable[[BaseException], None]) -> None:
        """Record ``end`` after the op; ``future`` is an async op's (or a DDP hook's) future, None for a
        synchronous op. ``complete(gpu_start_ns, gpu_end_ns)`` runs on the sidecar's thread once the GPU
        has finished the op; ``failed(error)`` where its future failed."""
        if future is None:
            _record(pair[1], self._current(pair[2]))
            self._timed.append((pair, complete))
        elif future.done():  # NCCL's future: done at once, its CUDA events mark the collective's end
            self._after(pair, future, complete, failed)
        else:  # a future completed by a CPU thread (gloo): the side stream waits once it has
            when_done(future, lambda done: self._after(pair, done, complete, failed))

    def _after(self, pair: tuple, future: Any, complete: Callable, failed: Callable) -> None:
        start, end, index = pair
        side = self._side.get(index)
        if side is None:
            side = self._side[index] = torch.cuda.Stream(index)
        current = torch._C._cuda_getCurrentStream(index)
        try:  # the side stream waits for the collective's events; the host does not
            torch._C._cuda_setStream(side.stream_id, side.device_index, side.device_type)
            future.wait()
            _record(end, side)
        except Exception as error:  # noqa: BLE001 — the op failed: it completes as such, on the CPU's clock
            failed(error)
            return
        finally:
            torch._C._cuda_setStream(*current)
        self._timed.append((pair, complete))

    def release(self, pair: tuple) -> None:
        """Give back the events of an op that completed without them (it failed, or completed on the CPU)."""
        self._free.append(pair)

    def check(self, tensor: torch.Tensor, report: Callable[[int], None]) -> bool:
        """Sum ``tensor`` on the device and have ``report(flags)`` called with NAN_HAS_* bits once the
        sum is on the host, if it is not finite. False when no pinned slot was free."""
        if not self._slots:
            self._slots = list(torch.empty(self.pool, dtype=torch.float32, pin_memory=True).unbind())
            self._free_slots.extend(range(self.pool))
        if not self._free_slots:
            process_ring.count_error("gpu_pool_exhausted")
            return False
        slot = self._free_slots.pop()
        values = torch.view_as_real(tensor) if tensor.is_complex() else tensor  # no temporary of its size
        self._slots[slot].copy_(values.sum(dtype=torch.float32), non_blocking=True)
        mark = self._free_marks.pop() if self._free_marks else torch.cuda.Event()
        _record(mark, self._current(tensor.device.index))
        self._checks.append((mark, slot, report))
        return True

    def _current(self, index: int) -> Any:
        """The current stream of device ``index`` (``torch.cuda.current_stream`` without its Python cost)."""
        key = torch._C._cuda_getCurrentStream(index)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1],
                                                            device_type=key[2])
        return stream

    # -- the sidecar's thread -----------------------------------------------------------------------

    def poll(self) -> None:
        """Complete what the GPU has finished; never blocks."""
        while self._checks and self._checks[0][0].query():
            mark, slot, report = self._checks.popleft()
            value = self._slots[slot].item()  # host memory: no device synchronisation
            self._free_slots.append(slot)
            self._free_marks.append(mark)
            if value != value:
                report(NAN_HAS_NAN)
            elif value in (float("inf"), float("-inf")):
                report(NAN_HAS_INF)
        while self._timed and self._timed[0][0][1].query():
            (start, end, index), complete = self._timed.popleft()
            reference, reference_ns = self._references[index]
            complete(reference_ns + int(reference.elapsed_time(start) * 1e6),
                     reference_ns + int(reference.elapsed_time(end) * 1e6))
            self._free.append((start, end, index))

    def _take(self, index: int) -> tuple | None:
        if index not in self._references:
            self._references[index] = _reference(index)
        for _ in range(len(self._free)):  # a pair of another device goes back to the end
            pair = self._free.pop()
            if pair[2] == index:
                return pair
            self._free.appendleft(pair)
        if self._created >= self.pool:
            process_ring.count_error("gpu_pool_exhausted")
            return None
        self._created += 1
        with torch.cuda.device(index):
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), index


_record = getattr(torch._C._CudaEventBase, "record", None)
"""``Event.record(stream)`` without looking the current stream up again in Python (None in CPU builds)."""


def _reference(device: int) -> tuple[Any, int]:
    """An event on an idle stream of ``device`` and the CPU's monotonic time at which the GPU passed it:
    the middle of [just before it was recorded, the first moment ``query()`` says it has been passed]
    — with nothing queued before it, microseconds apart. It polls; it never synchronises."""
    stream = torch.cuda.Stream(device)
    event = torch.cuda.Event(enable_timing=True)
    before = time.monotonic_ns()
    event.record(stream)
    deadline = before + 10_000_000
    while not event.query() and time.monotonic_ns() < deadline:
        pass
    return event, (before + time.monotonic_ns()) // 2


_tracker: GpuTracker | None = None


def poll() -> None:
    """The sidecar's hook: complete what the GPU has finished, if any collective ran on one."""
    if _tracker is not None:
        _tracker.poll()


def tracker() -> GpuTracker:
    """This process's tracker, counting into this process's ring."""
    global _tracker
    if _tracker is None:
        _tracker = GpuTracker()
    return _tracker
