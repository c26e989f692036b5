"""commlens.hooks — what runs on the training thread: hooks, the ring, the flight recorder, NaN checks.

Example::

    import torch.distributed as dist
    from commlens.hooks import FlightRecorderHook, NanCheckHook, instrument, register_post_hook

    instrument()                                   # every torch.distributed collective is recorded
    recorder = FlightRecorderHook(max_entries=1024).register_with_comm()
    NanCheckHook(mode="report").register_with_comm()
    register_post_hook(lambda a: print(a.name.value, a.duration_ns))
    dist.all_reduce(t)
    recorder.dump_file(dist.get_rank())            # torchfrtrace reads a folder of these
"""

from .distributed import instrument, is_instrumented, uninstrument
from .flight_recorder import FlightRecorderHook
from .nan_check import NanCheckHook
from .ops import AbortHookArgs, OpName, PostHookArgs, PreHookArgs
from .recorder import ring
from .registry import RemovableHandle, hook_errors, register_abort_hook, register_post_hook, register_pre_hook
from .ring import END, NAN, START, Record, Ring, RingReader

__all__ = [
    "AbortHookArgs", "END", "FlightRecorderHook", "NAN", "NanCheckHook", "OpName", "PostHookArgs",
    "PreHookArgs", "Record", "RemovableHandle", "Ring", "RingReader", "START", "hook_errors", "instrument",
    "is_instrumented", "register_abort_hook", "register_post_hook", "register_pre_hook", "ring", "uninstrument",
]
