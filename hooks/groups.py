"""Process groups as the recorder sees them: ``group_of(handle)`` gives a group's ``record.Group``.

Example::

    info = groups.known.get(pg) or groups.group_of(pg)
    if info is not groups.NOT_MEMBER:
        issuing.start(OpName.all_reduce, info, ...)
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .record import Group

NOT_MEMBER = object()
known: dict[Any, Any] = {}
"""Process group handle -> its ``record.Group``, or NOT_MEMBER; cleared when groups are destroyed."""


def group_of(handle: Any) -> Any:
    """The ``Group`` of ``handle``: a process group, None (the default group) or a group's name.
    Every handle of one group shares one ``Group``, so its sequence numbers are counted once."""
    if handle is None:
        pg = c10d._get_default_group()
    elif isinstance(handle, str):
        pg = c10d._resolve_process_group(handle)
    else:
        pg = handle
    found = known.get(pg)
    if found is None:
        if c10d._rank_not_in_group(pg):
            found = NOT_MEMBER
        else:
            try:
                pg._get_sequence_number_for_group()
                seq_source = pg._get_sequence_number_for_group
            except (AttributeError, RuntimeError):
                seq_source = None
            found = Group(pg, c10d._get_process_group_name(pg), getattr(pg, "group_desc", "undefined"),
                          c10d.get_process_group_ranks(pg), dist.get_rank(), str(dist.get_backend(pg)),
                          seq_source)
        known[pg] = found
    known[handle] = found
    return found
