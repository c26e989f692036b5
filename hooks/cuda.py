"""Collectives on CUDA tensors: completion and timing from two CUDA events around each (queueing,
then execution), and the NaN/Inf check's sum on the device, never synchronising the host: the
sidecar's thread ``poll()``s. The per-collective work is C++ (``_gpu.cpp``; the C all_reduce calls it
through ``native().api``), from pools bounded by ``POOL``; past it, or where that extension could not be
built, the op is timed on the CPU (or goes unchecked) and counted (``gpu_pool_exhausted``). An op that
needs no Python at its end hands the poll its END record to write, in C++, without the GIL (``Done``).
See docs/gpu.md.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable, Union

import torch

from commlens.ring import _producer
from commlens.ring.layout import GPU_START, NAN_HAS_INF, NAN_HAS_NAN

from . import extension, process_ring, record
from .futures import when_done

POOL = 4096
Done = Union[Callable[[int, int], None], tuple[Any, tuple[int, ...]]]
"""What completes an op on the GPU: ``complete(gpu_start_ns, gpu_end_ns)``, run on the sidecar's thread,
or (a ring's producer, END's fields: ``record.end_args``), which the poll writes as GPU_START and END itself."""


@functools.cache
def native() -> ModuleType | None:
    """``_gpu.cpp`` for this torch, loaded or built on first call; None where it cannot be built, with a warning."""
    return extension.load_or_warn("_gpu.cpp", "GPU extension",
                                  "times collectives on CUDA tensors on the CPU and leaves out their NaN check",
                                  lambda module: module.init(POOL, _producer.write_record_at,
                                                             (GPU_START, NAN_HAS_NAN, NAN_HAS_INF)))


class GpuTracker:
    def __init__(self, gpu: ModuleType | None):
        self._gpu = gpu
        self._side: dict[int, Any] = {}

    # -- the training thread ------------------------------------------------------------------------

    def start(self, device: torch.device) -> int | None:
        """Record ``start`` on the current stream; None when the pool is empty, or a CUDA graph is being
        captured (the op is timed on the CPU: at capture, not at its replays)."""
        if torch._C._cuda_isCurrentStreamCapturing():
            process_ring.count_error("gpu_captured")  # its replays will not be seen
            return None
        pair = -1 if self._gpu is None else self._gpu.start(
            device.index if device.index is not None else torch.cuda.current_device())
        if pair < 0:
            process_ring.count_error("gpu_pool_exhausted")
            return None
        return pair

    def end(self, pair: int, future: Any, done: Done, failed: Callable[[BaseException], None] | None) -> None:
        """Record ``end`` after the op; ``future`` is an async op's (or a DDP hook's) future, None for a
        synchronous op. ``done`` completes it once the GPU has finished it; ``failed(error)`` where its
        future failed (the pair given back already)."""
        if future is None:
            self._end(pair, done)
        elif future.done():  # NCCL's future: done at once, its CUDA events mark the collective's end
            self._after(pair, future, done, failed)
        else:  # a future completed by a CPU thread (gloo): the side stream waits once it has
            when_done(future, lambda completed: self._after(pair, completed, done, failed))

    def _end(self, pair: int, done: Done) -> None:
        if callable(done):
            self._gpu.end(pair, done)
        else:
            self._gpu.end_record(pair, *done)

    def _after(self, pair: int, future: Any, done: Done, failed: Callable) -> None:
        index = self._gpu.device_of(pair)
        side = self._side.get(index)
        if side is None:
            side = self._side[index] = torch.cuda.Stream(index)
        current = torch._C._cuda_getCurrentStream(index)
        try:  # the side stream waits for the collective's events; the host does not
            torch._C._cuda_setStream(side.stream_id, side.device_index, side.device_type)
            future.wait()
            self._end(pair, done)  # on the side stream, now current
        except Exception as error:  # noqa: BLE001 — the op failed: it completes as such, on the CPU's clock
            self._gpu.release(pair)
            failed(error)
        finally:
            torch._C._cuda_setStream(*current)

    def release(self, pair: int) -> None:
        """Give back the events of an op that completed without them (it failed, or completed on the CPU)."""
        self._gpu.release(pair)

    def check(self, tensor: torch.Tensor, nan: tuple[int, ...], found: Callable[[int], None]) -> bool:
        """Sum ``tensor`` on the device; where the sum is not finite, the poll writes the NAN record ``nan``
        (``record.nan_args``, its NAN_HAS_* bit added) and calls ``found(bit)``. False when no pinned slot
        was free, or a CUDA graph is being captured (unchecked: the sum would be read once, at capture)."""
        if torch._C._cuda_isCurrentStreamCapturing():
            return False
        if self._gpu is None or not self._gpu.check(tensor, record.producer(), nan, found):
            process_ring.count_error("gpu_pool_exhausted")
            return False
        return True

    # -- the sidecar's thread -----------------------------------------------------------------------

    def poll(self) -> None:
        """Complete what the GPU has finished; never blocks."""
        if self._gpu is None:
            return
        completed, found = self._gpu.poll()
        for told, bit in found:
            told(bit)
        for complete, start_ns, end_ns in completed:
            complete(start_ns, end_ns)


_tracker: GpuTracker | None = None


def poll() -> None:
    """The sidecar's hook: complete what the GPU has finished, if any collective ran on one."""
    if _tracker is not None:
        _tracker.poll()


def tracker() -> GpuTracker:
    """This process's tracker, counting into this process's ring."""
    global _tracker
    if _tracker is None:
        _tracker = GpuTracker(native())
    return _tracker
