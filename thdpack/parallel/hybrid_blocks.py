"""Hybrid (per-sample) context parallelism: the blocks of data-parallel × CP ranks a sample can run on.

Static CP splits every sample over the same ``cp`` ranks. Hybrid CP (megatron-core ≥ 0.19,
``hybrid_context_parallel=True``) gives each sample its own CP size ``k``, a power of two, and runs it on
one *aligned block* of the ``R`` data-parallel × CP ranks: positions ``start .. start + k − 1`` with
``start`` a multiple of ``k``. For ``R = 8``::

    k = 8   [0 1 2 3 4 5 6 7]
    k = 4   [0 1 2 3] [4 5 6 7]
    k = 2   [0 1] [2 3] [4 5] [6 7]
    k = 1   [0] [1] [2] [3] [4] [5] [6] [7]

These are the groups megatron-core's ``parallel_state.get_hybrid_data_context_parallel_groups(group_size=k)``
returns (``create_hybrid_dp_cp_groups``: ``ranks[i : i + k]`` for every power of two ``k`` below ``R``, the
whole data-parallel × CP group for ``k = R``). Inside its block a sample is split like a static CP pack
with ``cp = k`` (:mod:`thdpack.parallel.dual_chunk`): the rank at position ``j`` of the block keeps chunks
``j`` and ``2k − 1 − j``.

Positions here are *data-parallel × CP positions* ``0 .. R − 1``; :func:`hybrid_cp_groups` maps them to the
global ranks of each data-parallel × CP group (with tensor parallelism they are not ``0 .. R − 1``).
"""

from __future__ import annotations

from thdpack.common.align import check_int
from thdpack.parallel.groups import check_ranks


def block_sizes(world_size: int) -> tuple[int, ...]:
    """The CP sizes a sample can have on ``world_size`` data-parallel × CP ranks: the powers of two that
    divide ``world_size`` (``1, 2, 4, 8`` for 8 ranks; ``1, 2, 4`` for 12), smallest first; ``world_size``
    below 2**20 (:func:`thdpack.parallel.groups.check_ranks`)."""
    check_ranks(world_size, "world_size", "the data-parallel × context-parallel ranks")
    sizes, k = [], 1
    while world_size % k == 0:
        sizes.append(k)
        k *= 2
    return tuple(sizes)


def check_block(cp_size, block_start, world_size: int, what: str = "sample") -> None:
    """``ValueError`` (one line, naming ``what``, e.g. ``"sample 3"``, and the value) unless ``cp_size`` is a
    power of two dividing ``world_size`` and ``block_start`` a multiple of it inside the ranks."""
    check_int(cp_size, f"{what}: cp_size", 1)
    check_int(block_start, f"{what}: block_start", 0)
    if cp_size & (cp_size - 1):
        raise ValueError(f"{what}: cp_size={cp_size} is not a power of two (hybrid CP runs a sample on 1, 2, 4, ... "
                         "ranks)")
    if world_size % cp_size:
        raise ValueError(f"{what}: cp_size={cp_size} does not divide the {world_size} data-parallel × CP ranks "
                         f"(the sizes there: {', '.join(map(str, block_sizes(world_size)))})")
    if block_start % cp_size or block_start + cp_size > world_size:
        raise ValueError(f"{what}: a block of {cp_size} ranks at position {block_start} is not aligned (it must start "
                         f"at a multiple of {cp_size} below {world_size}: megatron-core's hybrid groups are "
                         f"ranks[i : i + {cp_size}])")


def block_ranks(cp_size: int, block_start: int, ranks=None) -> list[int]:
    """The ranks of a block: positions ``block_start .. block_start + cp_size − 1``, looked up in ``ranks``
    (the global ranks of the data-parallel × CP group, in order) when given."""
    positions = range(block_start, block_start + cp_size)
    return list(positions) if ranks is None else [int(ranks[p]) for p in positions]


def hybrid_cp_groups(dp_cp_ranks=None) -> dict:
    """Create every hybrid-CP block group, as megatron-core does; ``{k: group}`` for the calling process.

    A collective over the default ``torch.distributed`` group: every process calls it, with the same
    ``dp_cp_ranks``, because ``torch.distributed.new_group`` must be called by all of them for every group.

    Args:
        dp_cp_ranks: the global ranks of each data-parallel × CP group, a list of lists (megatron-core's
            ``RankGenerator.get_ranks("dp-cp")``; with tensor parallelism 2 on 8 processes
            ``[[0, 2, 4, 6], [1, 3, 5, 7]]``); default: one group of every rank, ``[[0 .. world − 1]]``.

    Returns:
        ``{k: ProcessGroup}`` for every block size ``k >= 2`` of the caller's data-parallel × CP group: the
        group of the aligned block of ``k`` that holds the caller (for ``k = R`` the whole data-parallel ×
        CP group). Pass it as ``thdpack.integrations.to_packed_seq_params(batch, cp_group=groups)``; megatron-core's own
        ``get_hybrid_data_context_parallel_groups`` is the same groups, made by ``initialize_model_parallel
        (hybrid_context_parallel=True)``.
    """
    import torch.distributed as dist

    me = dist.get_rank()
    lists = [list(range(dist.get_world_size()))] if dp_cp_ranks is None else [list(map(int, r)) for r in dp_cp_ranks]
    mine = {}
    for ranks in lists:
        for k in block_sizes(len(ranks))[1:]:
            for start in range(0, len(ranks), k):
                members = block_ranks(k, start, ranks)
                group = dist.new_group(members)
                if me in members:
                    mine[k] = group
    return mine
