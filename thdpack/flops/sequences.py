"""Sequence counts of packed batches: segment lengths from ``cu_seqlens``, ``Σ sᵢ²``
(exact, or lazily on the device) and a context-parallel rank's share of it; and the
counts of windowed and top-k attention (:func:`length_count`), per sample in closed form.

Causal attention over a pack does ``Σ sᵢ²`` work over the real sub-sequence lengths
``sᵢ``, not ``pack_len²``. Lengths are int64 here (int32 ``cu_seqlens`` in): sums of
squares overflow int32 quickly; exact sums switch to Python integers past int64.

A micro-batch whose ``cu_seqlens`` holds no tokens (``[0]``, or NeMo's ``[0, -1, -1]``
with argmin 1) beside tokens it does hold is counted the dense way, as Megatron-LM and
Megatron-Bridge do: ``B`` sequences of ``S`` tokens, ``B·S²`` (:func:`dense_square_sum`).
"""

from __future__ import annotations

import numpy as np
import torch

from thdpack.common.align import INT64_MAX, check_int, integer_array
from thdpack.parallel.cp import check_cp_args
from thdpack.parallel.dual_chunk import chunk_length, rank_chunks

__all__ = [
    "LENGTH_COUNT_KINDS",
    "check_count",
    "count_name",
    "cp_length_count_share",
    "cp_seqlen_squared_share",
    "dense_square_sum",
    "length_count",
    "length_count_values",
    "lengths_squared_sum",
    "parse_count_name",
    "segment_lengths",
    "segments_from_position_ids",
    "seqlen_squared_sum",
    "shows_no_tokens",
    "tree_length_count",
    "tree_seqlen_squared_sum",
]

_INT64_LIMIT = 2**63  # a sum of squares below this fits int64


def _as_int64_tensor(x, name: str) -> torch.Tensor:
    """``x`` as an int64 tensor (a tensor keeps its device); ``ValueError`` / ``TypeError`` naming
    ``name`` unless it holds integers (:func:`thdpack.common.align.integer_array`)."""
    x = integer_array(x, name)
    if isinstance(x, torch.Tensor):
        return x.to(torch.int64)
    return torch.as_tensor(x, dtype=torch.int64)


def check_count(value, name: str, *, square_sum: bool = False) -> None:
    """A FLOPs count (tokens, patches, ``Σ sᵢ²``, ...) must be an integer >= 0: the one
    integer rule, :func:`thdpack.common.align.check_int`, which names ``name`` in its
    ``ValueError``. A sum of squares (``square_sum=True``) may also be a Python int past
    int64, as :func:`lengths_squared_sum` returns it. A CPU tensor must hold one integer;
    a tensor on an accelerator is not read (that would be a host sync)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            return
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            shape = tuple(value.shape)
            raise ValueError(f"{name} must be an integer >= 0, got a {value.dtype} tensor of shape {shape}")
        value = int(value)
    if square_sum and type(value) is int and value > INT64_MAX:
        return
    check_int(value, name, 0, hint="; counts of tokens, patches and squared lengths are integers "
              "(FlopsAccumulator, seqlen_squared_sum and vision_seqlen_stats give them)")


def dense_square_sum(num_tokens, rows: int = 1):
    """``Σ sᵢ²`` of the dense count of a micro-batch of ``num_tokens`` tokens in ``rows``
    sequences of ``S = num_tokens / rows``: ``B·S² = num_tokens² // rows`` (Megatron-LM's
    ``mbs · seq_len²``). ``num_tokens`` may be an int or a tensor (then lazily, on its device)."""
    return num_tokens * num_tokens // rows


def shows_no_tokens(cu_seqlens, cu_seqlens_argmin=None) -> bool:
    """Whether ``cu_seqlens`` visibly holds no segment, without reading accelerator memory:
    fewer than 2 entries per row, or an ``argmin`` (an int, numpy or CPU tensor) that cuts
    every row at index 1 or before. False when only the values could tell."""
    if np.shape(cu_seqlens)[-1:] in ((0,), (1,)):
        return True
    if cu_seqlens_argmin is None:
        return False
    if isinstance(cu_seqlens_argmin, torch.Tensor) and cu_seqlens_argmin.device.type != "cpu":
        return False
    return int(np.max(np.asarray(cu_seqlens_argmin))) <= 1


def segment_lengths(cu_seqlens, cu_seqlens_argmin=None, *, name: str = "cu_seqlens") -> torch.Tensor:
    """Lengths of the valid segments of ``cu_seqlens`` (int64, same device, no host sync).

    Args:
        cu_seqlens: int ``[n+1]`` cumulative lengths, or ``[B, N]`` one row per
            micro-batch (NeMo / Megatron-Bridge packed batches), torch or numpy.
            A row is cut at its first negative entry (rows padded with ``-1``).
        cu_seqlens_argmin: optional index of the first padding entry of each row
            (an int, or a ``[B]`` / ``[B, 1]`` tensor): only ``cu_seqlens[:argmin]``
            is read. This is the NeMo convention, where ``argmin`` of a ``-1``
            padded row points at its first ``-1``.
        name: the argument named in errors (``"cu_seqlens_unpadded"``, ...).

    Both hold integers (``ValueError`` naming the argument for floats, NaN, bools, strings).
    On the CPU the values are checked too: every row starts at 0 and does not decrease
    before its cut, and ``argmin`` is >= 0; on an accelerator they are not read (no host sync).

    Returns:
        int64 ``[B, N-1]`` (``[1, n]`` for a 1-D input): segment lengths, 0 for
        entries past the cut. Zero-length segments stay 0 and so add nothing.
    """
    cu = _as_int64_tensor(cu_seqlens, name)
    if cu.ndim == 1:
        cu = cu.unsqueeze(0)
    if cu.ndim != 2:
        raise ValueError(f"{name} must be 1-D or 2-D, got shape {tuple(cu.shape)}")
    if cu.shape[1] == 0:
        return cu.new_zeros((cu.shape[0], 0))
    valid = torch.cumsum((cu < 0).to(torch.int64), dim=1) == 0  # before the first negative entry
    if cu_seqlens_argmin is not None:
        limit = _as_int64_tensor(cu_seqlens_argmin, f"{name}_argmin").to(cu.device).reshape(-1, 1)
        if limit.shape[0] not in (1, cu.shape[0]):
            raise ValueError(f"{name}_argmin has {limit.shape[0]} rows, {name} {cu.shape[0]}")
        if limit.device.type == "cpu" and bool((limit < 0).any()):
            raise ValueError(f"{name}_argmin must be >= 0 (the index of each row's first padding entry), "
                             f"got {int(limit.min())}")
        valid = valid & (torch.arange(cu.shape[1], device=cu.device).unsqueeze(0) < limit)
    lengths = cu[:, 1:] - cu[:, :-1]
    if cu.device.type == "cpu":
        _check_offsets(cu, valid, lengths, name)
    return torch.where(valid[:, 1:], lengths, torch.zeros_like(lengths))  # valid is a prefix per row


def _check_offsets(cu: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, name: str) -> None:
    """``ValueError`` naming ``name`` and the entry unless every row of the CPU int64 ``cu``
    (``[B, N]``) starts at 0 (a negative first entry: a row of padding only) and does not
    decrease within its ``valid`` prefix."""
    start = cu[:, 0]
    bad = torch.nonzero((start != 0) & (start >= 0))
    if bad.numel():
        b = int(bad[0, 0])
        where = f"[{b}, 0]" if cu.shape[0] > 1 else "[0]"
        raise ValueError(f"{name}{where} is {int(start[b])}; cumulative lengths start at 0")
    falls = torch.nonzero(valid[:, 1:] & (lengths < 0))
    if falls.numel():
        b, i = falls[0].tolist()
        where = (lambda j: f"[{b}, {j}]") if cu.shape[0] > 1 else (lambda j: f"[{j}]")
        raise ValueError(f"{name} must be non-decreasing within its valid entries, got {name}{where(i)} = "
                         f"{int(cu[b, i])} then {name}{where(i + 1)} = {int(cu[b, i + 1])}")


def lengths_squared_sum(lengths) -> int:
    """``Σ x²`` of int lengths (any shape; torch on any device, numpy or a list) as an
    exact Python int: int64 arithmetic, Python integers when the total could overflow.
    Host sync; raises ``ValueError`` on a negative length or one that is not an integer."""
    lengths = _as_int64_tensor(lengths, "lengths").cpu()
    if lengths.numel() == 0:
        return 0
    if bool((lengths < 0).any()):
        t = int(torch.nonzero(lengths.reshape(-1) < 0)[0, 0])
        raise ValueError(f"lengths must be >= 0, got {int(lengths.reshape(-1)[t])} at flat position {t} "
                         "(a decreasing cu_seqlens gives negative lengths)")
    if int(lengths.max()) * int(lengths.sum()) < _INT64_LIMIT:  # Σ x² <= max(x)·Σ x: int64 is exact
        return int((lengths * lengths).sum())
    return sum(v * v for v in lengths.flatten().tolist())  # Python ints: exact for any length


def tree_seqlen_squared_sum(seq_lens, parents) -> int:
    """The causal attention work of a prefix tree (shared-prefix packing) in the ``Σ sᵢ²`` convention.

    A root segment of ``s`` real tokens (a shared prefix, or a sample alone) costs ``s²``, as a
    sequence; a member of ``c`` own tokens after a prefix of ``p`` sees all ``p`` and itself causally,
    ``c·p + c·(c + 1)/2`` pairs, counted ``c·(2p + c)`` (the convention charges ``s²`` for the
    ``s·(s + 1)/2`` pairs of a sequence: twice the pairs less the tokens). So a group of ``k`` members
    of lengths ``Lⱼ = p + cⱼ`` costs ``p² + Σ cⱼ·(2p + cⱼ) = Σ Lⱼ² − (k − 1)·p²``. In a trie of any depth ``p``
    is the real length of all of a segment's ancestors.

    Args:
        seq_lens: int ``[S]`` real lengths of the segments (``ThdBatch.seq_lens``).
        parents: int ``[S]`` the parent segment of each, ``-1`` for a root (``thdpack.batching.document_parents(batch)``).

    Returns:
        A Python int (exact, as :func:`lengths_squared_sum`).
    """
    lens, above = _tree_ends(seq_lens, parents)
    return lengths_squared_sum(lens + above) - lengths_squared_sum(above)


def _tree_ends(seq_lens, parents) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[S]`` each segment's own length and the length of the prefixes above it (its ancestors' real
    tokens; 0 for a root), checked:
    ``ValueError`` unless ``parents`` holds one segment index (or -1) per segment."""
    lens = _as_int64_tensor(seq_lens, "seq_lens").cpu().reshape(-1)
    par = _as_int64_tensor(parents, "parents").cpu().reshape(-1)
    if par.shape != lens.shape or bool(((par < -1) | (par >= lens.numel())).any()):
        raise ValueError(f"parents must hold one segment index (or -1) per segment ({lens.numel()}), got shape "
                         f"{tuple(par.shape)}")
    above = torch.zeros_like(lens)  # the real tokens of every ancestor (a trie of any depth), level by level
    up = par
    for _ in range(lens.numel()):
        if not bool((up >= 0).any()):
            break
        above += torch.where(up >= 0, lens[up.clamp_min(0)], 0)
        up = torch.where(up >= 0, par[up.clamp_min(0)], -1)
    return lens, above


def seqlen_squared_sum(
    cu_seqlens=None,
    *,
    cu_seqlens_argmin=None,
    cu_seqlens_unpadded=None,
    cu_seqlens_unpadded_argmin=None,
    as_tensor: bool = False,
):
    """``Σ sᵢ²`` over the real sub-sequence lengths ``sᵢ = cu[i+1] − cu[i]``.

    Args:
        cu_seqlens: int ``[n+1]`` (or ``[B, N]``, rows summed) cumulative lengths,
            torch (any device) or numpy / list.
        cu_seqlens_argmin: cut each row at this index (NeMo's ``-1`` padding);
            without it a row is cut at its first negative entry anyway.
        cu_seqlens_unpadded: the real-length ``cu_seqlens`` when ``cu_seqlens``
            holds padded lengths (Megatron-Bridge with CP / FP8 padding). Preferred
            whenever given: attention runs over the real lengths.
        cu_seqlens_unpadded_argmin: its cut index.
            Offsets and cut indices are integers: ``ValueError`` naming the argument for
            floats, NaN, bools or strings, and (on the CPU) for a row that does not start at 0,
            decreases before its cut, or a negative cut (:func:`segment_lengths`).
        as_tensor: return a 0-dim int64 tensor on the input's device, computed
            without any host sync (the values of an accelerator tensor are not
            validated then, except what :func:`shows_no_tokens` sees; exact while ``Σ sᵢ² < 2⁶³``, always true
            for int32 ``cu_seqlens``). For numpy input a ``numpy.int64``.

    Returns:
        A Python int (exact: int64 arithmetic, switching to Python integers when the
        total could overflow), or the tensor described under ``as_tensor``.
        Zero-length segments contribute nothing.

    No tokens in the real lengths (counted dense, or a ``ValueError``): docs/flops.md, "seqlen_squared_sum: a
    micro-batch whose real lengths hold no tokens". A :class:`thdpack.ThdBatch` in place of ``cu_seqlens`` (alone):
    its ``seq_lens``' sum, a Python int; on a shared-prefix batch the tree's (:func:`tree_seqlen_squared_sum`).
    """
    if hasattr(cu_seqlens, "seq_lens") and hasattr(cu_seqlens, "cu_seqlens"):  # a ThdBatch (flops sits below it)
        others = (cu_seqlens_argmin, cu_seqlens_unpadded, cu_seqlens_unpadded_argmin)
        if as_tensor or any(v is not None for v in others):
            raise TypeError("seqlen_squared_sum(batch) takes no other argument (a ThdBatch carries its lengths); for "
                            "a tensor without a host sync pass batch.cu_seqlens with as_tensor=True")
        return _batch_square_sum(cu_seqlens)
    if cu_seqlens_unpadded is not None:
        name, cu, argmin = "cu_seqlens_unpadded", cu_seqlens_unpadded, cu_seqlens_unpadded_argmin
        layout = None if cu_seqlens is None else segment_lengths(cu_seqlens, cu_seqlens_argmin, name="cu_seqlens")
    else:
        name, cu, argmin, layout = "cu_seqlens", cu_seqlens, cu_seqlens_argmin, None
    if cu is None:
        raise ValueError("pass cu_seqlens or cu_seqlens_unpadded")
    lengths = segment_lengths(cu, argmin, name=name)
    if as_tensor:
        out = (lengths * lengths).sum()
        if layout is not None:
            out = torch.where(out == 0, dense_square_sum(layout.sum(), layout.shape[0]), out)
        elif shows_no_tokens(cu, argmin):
            raise ValueError(_no_tokens_message(name))
        return out if isinstance(cu, torch.Tensor) else np.int64(out.item())
    total = lengths_squared_sum(lengths)
    if total:
        return total
    if layout is None:
        raise ValueError(_no_tokens_message(name))
    return dense_square_sum(int(layout.sum()), layout.shape[0])


def _batch_square_sum(batch) -> int:
    """``Σ sᵢ²`` over a :class:`thdpack.ThdBatch`'s real lengths (a Python int: no int32 overflow); on a
    shared-prefix batch the tree's attention work, ``Σ_prefix p² + Σ_member c·(2p + c)``."""
    if batch.prefix_tree is not None:
        return tree_seqlen_squared_sum(batch.seq_lens, batch.prefix_tree.parents)
    s = batch.seq_lens.to(torch.int64)
    return int((s * s).sum())


def _no_tokens_message(name: str) -> str:
    return (
        f"{name} holds no tokens before its cut, so Σ sᵢ² of the micro-batch is unknown here (0 would report no "
        "attention work for a micro-batch that has tokens): pass the layout as cu_seqlens beside "
        "cu_seqlens_unpadded, or count it with FlopsAccumulator.add_cu_seqlens(..., num_padded_tokens=T) or "
        "FlopsAccumulator.add(inputs with input_ids), which fall back to the dense B·S² count"
    )


def cp_seqlen_squared_share(seq_lens, cu_seqlens_padded, cp_size: int, cp_rank: int):
    """CP rank ``cp_rank``'s exact share of ``Σ sᵢ²`` under the dual-chunk split
    (:mod:`thdpack.parallel.dual_chunk`), from the real lengths ``seq_lens`` (int ``[n]``) and
    ``cu_seqlens_padded`` (int ``[n+1]``), torch or numpy.

    Sample i's padded span ``Pᵢ`` is cut into ``2·cp`` chunks of ``hᵢ = Pᵢ / (2·cp)``;
    rank r holds chunks ``r`` and ``2·cp−1−r``. Chunk c holds real positions
    ``[aᵢ, bᵢ)`` with ``a = min(s, c·h)``, ``b = min(s, (c+1)·h)``, and its causal
    attention work is ``(b² − a²)/2`` (queries at q attend to keys 0..q). The share is
    ``Σᵢ Σ_{c ∈ {r, 2cp−1−r}} (bᵢ,c² − aᵢ,c²)``: the attention this rank computes,
    and the shares of all ranks add up to ``Σ sᵢ²`` exactly (the chunks tile each sample).

    Returns an int64 0-dim tensor on the device of ``seq_lens`` (no host sync).
    """
    check_cp_args(cp_size, cp_rank)
    s = _as_int64_tensor(seq_lens, "seq_lens")
    cu = _as_int64_tensor(cu_seqlens_padded, "cu_seqlens_padded").to(s.device)
    h = chunk_length(cu[1:] - cu[:-1], cp_size)
    share = torch.zeros((), dtype=torch.int64, device=s.device)
    for c in rank_chunks(cp_size, cp_rank):  # the two chunks: two vector steps
        lo = torch.minimum(s, c * h)
        hi = torch.minimum(s, (c + 1) * h)
        share = share + (hi * hi - lo * lo).sum()
    return share


def segments_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment lengths (int64 ``[n]``) of one packed row whose ``position_ids`` (any shape
    holding ``T`` positions) restart at 0 for every sample."""
    pos = position_ids.reshape(-1)
    total = pos.numel()
    starts = torch.nonzero(pos == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    ends = torch.cat([starts[1:], starts.new_tensor([total])])
    return (ends - starts).to(torch.int64)



# --------------------------------------------------------------------------- windowed and top-k counts
#
# Every attention count here is a sum over samples of a function ``G(s)`` of the sample's real length,
# and ``G(s) = Σ_{t=1..s} g(t)`` is the work of the queries at positions 1..s: a CP rank that holds
# positions ``[a, b)`` of a sample does ``G(b) − G(a)`` of it, and a shared-prefix member after a prefix
# of ``p`` tokens ``G(p + c) − G(p)``: the shares add up to the sample's ``G(s)`` exactly.

LENGTH_COUNT_KINDS = ("seqlen_squared_sum", "causal_pairs", "window_square_sum")


def count_name(kind: str, size: int | None = None) -> str:
    """The name of a length count: ``kind`` alone (``"seqlen_squared_sum"``, ``"causal_pairs"``) or with
    its window / top-k size, ``"window_square_sum[4096]"``, ``"causal_pairs[2048]"``."""
    if kind not in LENGTH_COUNT_KINDS:
        raise ValueError(f"unknown length count {kind!r}; the kinds are {', '.join(LENGTH_COUNT_KINDS)}")
    if size is None:
        if kind == "window_square_sum":
            raise ValueError("window_square_sum needs its window size: count_name('window_square_sum', w)")
        return kind
    check_int(size, f"the size of {kind}", 1)
    return f"{kind}[{int(size)}]"


def parse_count_name(name: str) -> tuple[str, int | None]:
    """``("window_square_sum", 4096)`` for ``"window_square_sum[4096]"``, ``("causal_pairs", None)`` for
    ``"causal_pairs"``; ``ValueError`` naming ``name`` when it is not a length count."""
    kind, _, rest = str(name).partition("[")
    size = None
    if rest:
        if not rest.endswith("]") or not rest[:-1].isdigit() or int(rest[:-1]) < 1:
            raise ValueError(f"{name!r} is not a length count (e.g. 'window_square_sum[4096]')")
        size = int(rest[:-1])
    if kind not in LENGTH_COUNT_KINDS or (kind == "window_square_sum" and size is None) or (
            kind == "seqlen_squared_sum" and size is not None):
        raise ValueError(f"{name!r} is not a length count; the kinds are {', '.join(LENGTH_COUNT_KINDS)} "
                         "(window_square_sum and causal_pairs take a size: 'window_square_sum[4096]')")
    return kind, size


def length_count_values(lengths: torch.Tensor, name: str) -> torch.Tensor:
    """``G(s)`` of every length (int64 tensor in, int64 tensor of the same shape and device out, no host sync):

    - ``seqlen_squared_sum``: ``s²``, the causal convention of full attention (``s²`` for the
      ``s·(s+1)/2`` pairs of a sequence, as Megatron-LM counts it);
    - ``causal_pairs``: ``s·(s+1)/2``, the (query, key) pairs of causal attention, exactly;
    - ``causal_pairs[k]``: ``Σ_{t=1..s} min(t, k)``, every query attending to at most ``k`` of the keys
      before it (DeepSeek sparse attention's top-k): ``s·(s+1)/2`` up to ``s = k``, then
      ``k·(k+1)/2 + k·(s − k)``;
    - ``window_square_sum[w]``: causal attention in a window of ``w`` keys (the query and the ``w − 1``
      before it) in the unit of ``Σ sᵢ²``: ``s²`` while the window does not cut the sample (``s ≤ w``: it
      is full attention) and ``2·Σ_{t=1..s} min(t, w) = w·(w+1) + 2·w·(s − w)`` once it does, which is
      Megatron-Bridge's exact causal window context. A window layer costs what a full one does on a
      sample no longer than its window.
    """
    kind, size = parse_count_name(name)
    s = lengths.to(torch.int64)
    if kind == "seqlen_squared_sum":
        return s * s
    if kind == "causal_pairs":
        if size is None:
            return s * (s + 1) // 2
        m = torch.clamp(s, max=size)
        return m * (m + 1) // 2 + size * (s - m)
    return torch.where(s <= size, s * s, size * (size + 1) + 2 * size * (s - size))


def length_count(lengths, name: str) -> int:
    """``Σ G(s)`` (:func:`length_count_values`) over int lengths (any shape; torch on any device, numpy
    or a list) as an exact Python int: int64 arithmetic, Python integers when the total could overflow
    (every ``G(s) <= 2·s²``). Host sync; ``ValueError`` on a negative length, as :func:`lengths_squared_sum`."""
    lengths = _as_int64_tensor(lengths, "lengths").cpu().reshape(-1)
    if lengths.numel() == 0:
        return 0
    if bool((lengths < 0).any()):
        t = int(torch.nonzero(lengths < 0)[0, 0])
        raise ValueError(f"lengths must be >= 0, got {int(lengths[t])} at flat position {t}")
    if 2 * int(lengths.max()) * int(lengths.sum()) < _INT64_LIMIT:
        return int(length_count_values(lengths, name).sum())
    kind, size = parse_count_name(name)  # Python integers: exact for any length
    return sum(_python_count(v, kind, size) for v in lengths.tolist())


def _python_count(s: int, kind: str, size: int | None) -> int:
    """:func:`length_count_values` of one length in Python integers."""
    if kind == "seqlen_squared_sum":
        return s * s
    if kind == "causal_pairs":
        m = s if size is None else min(s, size)
        return m * (m + 1) // 2 + (0 if size is None else size * (s - m))
    return s * s if s <= size else size * (size + 1) + 2 * size * (s - size)


def cp_length_count_share(seq_lens, cu_seqlens_padded, cp_size: int, cp_rank: int, name: str) -> torch.Tensor:
    """CP rank ``cp_rank``'s share of the length count ``name`` under the dual-chunk split, as
    :func:`cp_seqlen_squared_share` is of ``Σ sᵢ²``: the chunk holding real positions ``[a, b)`` of a
    sample adds ``G(b) − G(a)``; the ranks' shares add up to ``Σ G(sᵢ)`` exactly. An int64 0-dim tensor
    on the device of ``seq_lens`` (no host sync)."""
    check_cp_args(cp_size, cp_rank)
    s = _as_int64_tensor(seq_lens, "seq_lens")
    cu = _as_int64_tensor(cu_seqlens_padded, "cu_seqlens_padded").to(s.device)
    h = chunk_length(cu[1:] - cu[:-1], cp_size)
    share = torch.zeros((), dtype=torch.int64, device=s.device)
    for c in rank_chunks(cp_size, cp_rank):
        lo = torch.minimum(s, c * h)
        hi = torch.minimum(s, (c + 1) * h)
        share = share + (length_count_values(hi, name) - length_count_values(lo, name)).sum()
    return share


def tree_length_count(seq_lens, parents, name: str) -> int:
    """The length count ``name`` of a prefix tree (shared-prefix packing), as
    :func:`tree_seqlen_squared_sum` is of ``Σ sᵢ²``: a root segment of ``s`` tokens adds ``G(s)``, a
    member of ``c`` own tokens after a prefix of ``p`` adds ``G(p + c) − G(p)`` (its queries sit at
    positions ``p+1 .. p+c`` and see the prefix). A Python int."""
    lens, above = _tree_ends(seq_lens, parents)
    return length_count(lens + above, name) - length_count(above, name)
