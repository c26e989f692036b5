"""Pre-, post- and abort-hook registration, and calling them without hurting the job.

Hooks run in registration order; one that raises is counted in ``hook_errors`` and warned about once,
unless registered with ``propagate=True`` (docs/hooks.md).

Example::

    handle = register_pre_hook(lambda args: print(args.name, args.op_id))
    ...
    handle.remove()  # idempotent
"""

from __future__ import annotations

import collections
import functools
import inspect
import warnings
from typing import Any, Callable

from . import process_ring
from ._state import state

Hook = Callable[..., None]
Reporter = Callable[[Any], "tuple[int, int] | None"]
"""An input check's findings in a CPU tensor whose scan found NaN or Inf: its NAN record's (flags,
count), or None where the check must run itself."""
Found = Callable[[int], None]
"""An input check told of a finding on a CUDA tensor (its NAN_HAS_* bit) whose NAN record the GPU's poll wrote."""


class _Hooks:
    """One ordered list of hooks. ``entries`` is a tuple, rebuilt on change, so callers iterate it
    without a lock while another thread registers or removes."""

    def __init__(self, kind: str):
        self.kind = kind
        self.entries: tuple[tuple[Hook, bool], ...] = ()
        self.input_checks: tuple[Hook, ...] = ()
        """The entries' hooks registered as input checks (``register_input_check``)."""
        self.reporters: tuple[tuple[Hook, Reporter, Found], ...] = ()
        """The input checks' ``report`` and ``found``, by hook (``register_input_check``)."""

    def add(self, hook: Hook, propagate: bool, input_check: bool = False,
            report: tuple[Reporter, Found] | None = None) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"register_{self.kind}_hook() takes a callable; got {type(hook).__name__} {hook!r}")
        if any(_unwrapped(existing) is _unwrapped(hook) for existing, _ in self.entries):
            raise ValueError(f"{hook!r} is already registered among the {self.kind} hooks; "
                             "remove its handle before registering it again")
        if input_check:
            self.input_checks = self.input_checks + (hook,)
        if report is not None:
            self.reporters = self.reporters + ((hook, *report),)
        self.entries = self.entries + ((hook, propagate),)
        _update_hooked()
        return RemovableHandle(self, hook)

    def discard(self, hook: Hook) -> None:
        self.entries = tuple(entry for entry in self.entries if entry[0] is not hook)
        self.input_checks = tuple(check for check in self.input_checks if check is not hook)
        self.reporters = tuple(entry for entry in self.reporters if entry[0] is not hook)
        _update_hooked()

    def call(self, args: object, in_caller: bool = True, inputs_finite: bool = False) -> None:
        """Run every hook on ``args``. Off the caller's thread (``in_caller=False``) nothing can
        reach the caller, so even propagating hooks are only counted. ``inputs_finite``: the caller
        proved every input finite, and the input checks are left out."""
        for hook, propagate in self.entries:
            if inputs_finite and hook in self.input_checks:
                continue
            try:
                hook(args)
            except Exception as error:
                if propagate and in_caller:
                    raise
                _report(self.kind, hook, error)


def _unwrapped(hook: Hook) -> Hook:
    """The hook the user registered (``register_abort_hook`` wraps torchcomms' no-argument form)."""
    return getattr(hook, "_commlens_registered", hook)


class RemovableHandle:
    """Returned by every ``register_*_hook``; ``remove()`` unregisters, and is safe to call twice."""

    __slots__ = ("_hooks", "_hook")

    def __init__(self, hooks: _Hooks, hook: Hook):
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook is not None:
            self._hooks.discard(self._hook)
            self._hook = None

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


hook_errors: collections.Counter[str] = collections.Counter()
"""Exceptions raised by hooks, by hook name; each hook's first one is also warned about."""


def _report(kind: str, hook: Hook, error: Exception) -> None:
    name = getattr(hook, "__qualname__", None) or repr(hook)
    hook_errors[name] += 1
    process_ring.count_error("hook")  # in the ring's header, where a pod sidecar reads it too
    if hook_errors[name] == 1:
        warnings.warn(f"commlens {kind}-hook {name} raised {error!r}; the collective went on, "
                      "and later errors of this hook are only counted", RuntimeWarning, stacklevel=2)


pre_hooks, post_hooks, abort_hooks = _Hooks("pre"), _Hooks("post"), _Hooks("abort")


def _update_hooked() -> None:
    """The hot path's state (``_state.c``) after a hook came or went: ``hooked``, whether a pre- or post-hook
    that must see every collective is registered (abort hooks run where a collective fails, on every
    path); ``checking_inputs``, whether an input check is (``register_input_check``); ``reporting`` and
    ``reporting_found``, the one input check's ``report`` and ``found`` where it is the only one and has
    them: a collective whose inputs hold NaN or Inf then needs no frame of the check's, only the NAN
    record (the C all_reduce writes it; on a CUDA tensor, the GPU's poll)."""
    state.hooked = bool(post_hooks.entries) or len(pre_hooks.entries) > len(pre_hooks.input_checks)
    state.checking_inputs = bool(pre_hooks.input_checks)
    checks = pre_hooks.input_checks
    state.reporting, state.reporting_found = next(((report, found) for hook, report, found in pre_hooks.reporters
                                                   if len(checks) == 1 and hook is checks[0]), (None, None))


def register_pre_hook(hook: Hook, *, propagate: bool = False) -> RemovableHandle:
    """Call ``hook(PreHookArgs)`` before every instrumented collective is issued.

    With ``propagate=True`` an exception from the hook reaches the caller and the collective is
    not issued (what ``NanCheckHook(mode="raise")`` uses); otherwise it is counted and ignored.
    """
    return pre_hooks.add(hook, propagate)


def register_input_check(hook: Hook, *, propagate: bool = False,
                         report: tuple[Reporter, Found] | None = None) -> RemovableHandle:
    """A pre-hook that does nothing when every input tensor is finite (``NanCheckHook``'s): the hot
    path may skip it for a collective whose inputs its own scan found finite (hooks/nan_check.py).
    ``report``: where all the hook does with a tensor holding NaN or Inf is one NAN record (the
    NaN check in report mode), (that record's (flags, count) for a CPU tensor, for the hot path to
    write itself; what to tell the hook of a finding on a CUDA tensor, whose record the GPU's poll wrote)."""
    return pre_hooks.add(hook, propagate, input_check=True, report=report)


def register_post_hook(hook: Hook, *, propagate: bool = False) -> RemovableHandle:
    """Call ``hook(PostHookArgs)`` when every instrumented collective completes or fails; for async
    ops that is on the thread that saw the work complete, never by blocking the caller."""
    return post_hooks.add(hook, propagate)


def register_abort_hook(hook: Hook) -> RemovableHandle:
    """Call ``hook(AbortHookArgs)`` when a collective fails or times out, before the error reaches
    the caller; or ``hook()``, torchcomms' form, where it takes no argument."""
    if callable(hook) and _takes_no_argument(hook):
        hook = _called_without_arguments(hook)
    return abort_hooks.add(hook, False)


def _called_without_arguments(hook: Hook) -> Hook:
    def call(args: object) -> None:
        hook()
    functools.update_wrapper(call, hook)
    call._commlens_registered = hook  # what the user registered: a second registration of it is refused
    return call


def _takes_no_argument(hook: Hook) -> bool:
    try:
        parameters = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as documented
        return False
    return not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)
