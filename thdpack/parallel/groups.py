"""The arguments that name ranks: a process group (``group=``, ``cp_group=``, ``sp_group=``) and a number of
ranks (a world size, a CP size), each checked by one rule before any collective or per-rank array.

A process group is an object ``torch.distributed`` made (``new_group``, ``dist.group.WORLD``, megatron-core's
``parallel_state`` getters), passed on to ``torch.distributed`` as it is; plain data in its place (a string
such as ``"cp"``, a number, a list of ranks) is a ``TypeError`` naming the argument here, not an error from
deep inside ``torch.distributed`` (or none, where the group is only stored).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Set

from thdpack.common.align import check_int, is_bool

# Bound on a number of ranks: plans keep arrays, and schedules a list, per rank (about 100 bytes a rank), so
# a world size in the trillions would exhaust memory before any check of its own; 2**20 is beyond any cluster.
MAX_RANKS = 2**20

GROUP = "a torch.distributed process group (torch.distributed.new_group, dist.group.WORLD)"


def check_ranks(value, name: str, what: str) -> None:
    """``ValueError`` unless ``value``, a number of ranks, is an integer >= 1
    (:func:`thdpack.common.align.check_int`) below :data:`MAX_RANKS`, the message saying what a larger one
    would need; ``what`` says which ranks (``"the data-parallel × context-parallel ranks"``)."""
    check_int(value, name, 1, hint=f" ({what})")
    if value >= MAX_RANKS:
        raise ValueError(f"{name}={value} ({what}) would need {8 * int(value) / 2**30:,.1f} GiB for each per-rank "
                         "array of a plan; it must be below 2**20 (more ranks than any cluster has)")


def check_process_group(group, name: str, takes: str = f"{GROUP} or None") -> None:
    """``TypeError`` naming ``name`` and what it takes (``takes``) when ``group`` is plain data: a string or
    bytes, a number or bool, a list / tuple / set of ranks, a mapping where none is taken, an array. None and
    any other object pass (``torch.distributed`` checks a group itself, where it is initialised)."""
    if isinstance(group, (str, bytes, numbers.Number, list, tuple, Set, Mapping)) or is_bool(group) \
            or hasattr(group, "__array__"):
        raise TypeError(f"{name} must be {takes}, got {group!r:.80} ({type(group).__name__})")
