"""``FlightRecorderHook``: the last collectives of this process, in PyTorch's flight-recorder format.

A reader of the ring, not a second buffer (docs/hooks.md); PyTorch's own analyzer reads a
directory of its dumps::

    recorder = FlightRecorderHook(max_entries=1024)
    recorder.register_with_comm()          # every torch.distributed group; or a group, or a torchcomms comm
    ...
    json_trace = recorder.dump_json()      # or .dump(): the same, as a dict
    recorder.dump_file(rank=dist.get_rank())  # $TORCHCOMM_FR_DUMP_TEMP_FILE<rank>
    recorder.unregister()
    # $ torchfrtrace DIR

``commlens.ring.dumps`` builds the dump, from this process's ring or any other.
"""

from __future__ import annotations

import json
from typing import Any

from commlens.ring.dumps import as_dump, current_attempt, entries, write_dump

from . import process_ring
from .record import new_op_id


class FlightRecorderHook:
    """Keeps the last ``max_entries`` collectives of the groups it is registered with."""

    def __init__(self, max_entries: int = 2048):
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"FlightRecorderHook max_entries={max_entries!r} is not accepted: "
                             "it must be a positive integer")
        slots = process_ring.ring().slots
        if 2 * max_entries > slots:
            raise ValueError(f"FlightRecorderHook max_entries={max_entries} needs a ring of at least "
                             f"{2 * max_entries} slots (two records per collective); the ring has {slots}: "
                             "set COMMLENS_RING_SLOTS to a larger power of two")
        self.max_entries = max_entries
        self._groups: set[str] | None = set()  # names of recorded groups; None: every torch.distributed group
        self._handles: list[Any] = []
        self._from_op_id: int | None = None
        self._until_op_id: int | None = None

    def register_with_comm(self, comm: Any = None) -> FlightRecorderHook:
        """Record ``comm``: a torchcomms communicator, one torch.distributed process group, or every
        torch.distributed group when None. Entries start with the next collective."""
        if self._from_op_id is None:
            self._from_op_id = new_op_id()
        self._until_op_id = None
        if comm is None:
            self._groups = None
        elif hasattr(comm, "register_pre_hook"):
            from .torchcomms import attach

            handle = attach(comm)
            self._handles.append(handle)
            if self._groups is not None:
                self._groups.add(handle.group.name)
        else:
            import torch.distributed.distributed_c10d as c10d

            if self._groups is not None:
                self._groups.add(c10d._get_process_group_name(comm))
        return self

    def unregister(self) -> None:
        """Stop recording; what was recorded so far can still be dumped."""
        while self._handles:
            self._handles.pop().remove()
        if self._from_op_id is not None:
            self._until_op_id = new_op_id()

    def entries(self) -> tuple[list[dict], dict, dict]:
        """(entries, pg_config, pg_status) of the recorded collectives still in the ring, oldest first."""
        if self._from_op_id is None:
            return [], {}, {}
        return entries(process_ring.ring(), self.max_entries, self._from_op_id, self._until_op_id, self._groups)

    def dump(self) -> dict:
        """The dump as a dict, in PyTorch's flight-recorder schema."""
        return as_dump(*self.entries(), _comm_lib_version())

    def dump_json(self) -> str:
        """The dump as JSON text, as torchcomms' ``FlightRecorderHook.dump_json`` gives it (its
        ``process_group`` pairs become lists)."""
        return json.dumps(self.dump())

    def dump_file(self, rank: int) -> str:
        """``write_dump`` of this recorder's dump (in this process's attempt's folder); returns its path."""
        return write_dump(self.dump(), rank, attempt=current_attempt())


def _comm_lib_version() -> str:
    import torch

    return f"torch {torch.__version__}"
