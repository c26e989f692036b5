"""commlens.hooks — what runs on the training thread: hooks, the ring's writers, the flight recorder, NaN checks.

Example::

    import torch.distributed as dist
    from commlens.hooks import FlightRecorderHook, NanCheckHook, instrument, register_post_hook, watch_loss_scaling

    instrument()                                   # every torch.distributed collective is recorded
    recorder = FlightRecorderHook(max_entries=1024).register_with_comm()
    NanCheckHook(mode="report").register_with_comm()
    watch_loss_scaling()                           # GradScaler's skipped steps: its overflow, no fault
    register_post_hook(lambda a: print(a.name.value, a.duration_ns))
    dist.all_reduce(t)
    recorder.dump_file(dist.get_rank())            # torchfrtrace reads a folder of these

Names are imported on first use: what reads a ring imports no torch.
"""

from .lazy import lazy_names


def ring():
    """This process's ring (``process_ring.ring()``), created on first use."""
    from .process_ring import ring as this_process

    return this_process()


_HOMES = {
    "instrument": "distributed", "is_instrumented": "distributed", "uninstrument": "distributed",
    "FlightRecorderHook": "flight_recorder", "NanCheckHook": "nan_check", "watch_loss_scaling": "loss_scale",
    "AbortHookArgs": "ops", "OpName": "ops", "PostHookArgs": "ops", "PreHookArgs": "ops",
    "RemovableHandle": "registry", "hook_errors": "registry", "register_abort_hook": "registry",
    "register_post_hook": "registry", "register_pre_hook": "registry",
    "END": "commlens.ring", "NAN": "commlens.ring", "START": "commlens.ring", "Record": "commlens.ring",
    "Ring": "commlens.ring", "RingReader": "commlens.ring",
}

__all__ = sorted([*_HOMES, "ring"])
__getattr__ = lazy_names(__name__, _HOMES)
