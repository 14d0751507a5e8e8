"""Context-parallel (CP) index arithmetic of a THD stream: TransformerEngine's load-balanced
"dual chunk" split, as a pure function of ``cu_seqlens_padded``, ``cp_size`` and ``cp_rank``.

Each sample's padded span of length ``P`` (a multiple of ``2·cp``) is cut into
``2·cp`` chunks of ``h = P / (2·cp)`` tokens; rank ``r`` keeps chunk ``r`` and
chunk ``2·cp − 1 − r``, in that order, sample after sample (the rule itself:
:mod:`thdpack.parallel.dual_chunk`). Under causal attention the two chunks together cost
every rank the same work.

This module works on lengths and tensors only and knows nothing of
:class:`thdpack.ThdBatch`; the batch-level verb, ``thdpack.shard(batch, cp_size=, cp_rank=)``
(``ThdBatch.shard`` the field it sets), lives with the batch in :mod:`thdpack.batching.batch` and calls these.
"""

from __future__ import annotations

import numpy as np
import torch

from thdpack.common.align import check_int, integer_array
from thdpack.parallel.dual_chunk import chunk_length, rank_chunks


def check_cp_args(cp_size, cp_rank) -> None:
    """``ValueError`` unless ``cp_size >= 1`` and ``0 <= cp_rank < cp_size``."""
    check_int(cp_size, "cp_size", 1)
    check_int(cp_rank, "cp_rank", 0, below=cp_size)


def _padded_lengths(cu_seqlens_padded, cp_size: int):
    """``(cu, lengths)`` as int64 (numpy for host data, torch for device tensors), validated."""
    cu = _as_int64(cu_seqlens_padded, "cu_seqlens_padded")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens_padded must be 1-D with at least one entry, got shape {tuple(cu.shape)}")
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError("cu_seqlens_padded must start at 0 and be non-decreasing")
    if cp_size > 1:
        bad = (lengths % (2 * cp_size)).nonzero()
        bad = bad[0] if isinstance(bad, tuple) else bad.flatten()
        if bad.shape[0]:
            i = int(bad[0])
            raise ValueError(
                f"sample {i} has padded length {int(lengths[i])}, not a multiple of 2·cp = {2 * cp_size}; "
                f"build the batch with cp_size={cp_size} (or plan/pad to thdpack.cp_pad_multiple({cp_size}))"
            )
    return cu, lengths


def dual_chunk_offsets(padded_lengths, cp_size: int, cp_rank: int):
    """Where rank ``cp_rank``'s tokens sit inside their samples.

    Args:
        padded_lengths: int64 ``[n]`` numpy array or torch tensor of padded lengths
            (multiples of ``2·cp_size`` when ``cp_size > 1``).

    Returns:
        ``(sample, offset)``, both int64 ``[Σ P / cp_size]`` of the input's kind:
        the sample of every local token and its offset inside that sample's padded
        span (chunk ``r`` first, then chunk ``2·cp − 1 − r``).
    """
    xp = _ArrayOps(padded_lengths)
    n = padded_lengths.shape[0]
    if cp_size == 1:
        chunk_len, chunk_first, chunk_sample = padded_lengths, padded_lengths * 0, xp.arange(n)
    else:
        h = chunk_length(padded_lengths, cp_size)
        first_chunk, second_chunk = rank_chunks(cp_size, cp_rank)
        chunk_len = xp.repeat(h, 2)
        chunk_first = xp.stack_interleave(h * first_chunk, h * second_chunk)
        chunk_sample = xp.repeat(xp.arange(n), 2)
    local_total = int(chunk_len.sum())
    chunk_local_start = xp.cumsum(chunk_len) - chunk_len
    offset = xp.arange(local_total) + xp.repeat(chunk_first - chunk_local_start, chunk_len, local_total)
    return xp.repeat(chunk_sample, chunk_len, local_total), offset


class _ArrayOps:
    """The few array operations the partition needs, for numpy arrays and torch tensors alike."""

    def __init__(self, like):
        self.torch = isinstance(like, torch.Tensor)
        self.device = like.device if self.torch else None

    def arange(self, n):
        return torch.arange(n, dtype=torch.int64, device=self.device) if self.torch else np.arange(n, dtype=np.int64)

    def repeat(self, values, counts, total=None):
        if self.torch:
            return torch.repeat_interleave(values, counts, output_size=total)
        return np.repeat(values, counts)

    def cumsum(self, values):
        return torch.cumsum(values, 0) if self.torch else np.cumsum(values)

    def stack_interleave(self, a, b):
        return torch.stack([a, b], 1).reshape(-1) if self.torch else np.stack([a, b], 1).reshape(-1)


def _as_int64(values, name: str):
    """numpy int64 for host data (fast), torch int64 for device tensors; integers only
    (:func:`thdpack.common.align.integer_array` names ``name`` otherwise)."""
    values = integer_array(values, name)
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        return values.to(torch.int64)
    if isinstance(values, torch.Tensor):
        return values.numpy().astype(np.int64)
    return values.astype(np.int64, copy=False)


def partition_indices(cu_seqlens_padded, cp_size: int, cp_rank: int):
    """:func:`thd_partition_indices` without the torch wrapping: numpy in, numpy out
    (or torch in, torch out for device tensors)."""
    check_cp_args(cp_size, cp_rank)
    cu, lengths = _padded_lengths(cu_seqlens_padded, cp_size)
    sample, offset = dual_chunk_offsets(lengths, cp_size, cp_rank)
    return cu[:-1][sample] + offset


def thd_partition_indices(cu_seqlens_padded, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Stream positions that CP rank ``cp_rank`` keeps, equal to TransformerEngine's
    ``thd_get_partitioned_indices``.

    Args:
        cu_seqlens_padded: int ``[n+1]`` cumulative padded lengths (list, numpy, or a
            torch tensor on any device); every padded length must be a multiple of
            ``2·cp_size``.
        cp_size: number of CP ranks (1 gives the identity).
        cp_rank: this rank.

    Returns:
        int64 ``[cu_seqlens_padded[-1] / cp_size]``, on the input's device.
    """
    out = partition_indices(cu_seqlens_padded, cp_size, cp_rank)
    return out if isinstance(out, torch.Tensor) else torch.from_numpy(out)


def local_seq_lens(seq_lens, cu_seqlens_padded, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Real tokens of each sample that land on ``cp_rank`` (int32 ``[n]``).

    TransformerEngine's rule: ``clamp(s − r·h, 0, h) + clamp(s − (2cp−1−r)·h, 0, h)``
    with ``h = P / (2·cp)``, since real tokens sit at the start of each padded span.
    With one rank it is ``seq_lens`` itself.
    """
    check_cp_args(cp_size, cp_rank)
    _, lengths = _padded_lengths(cu_seqlens_padded, cp_size)
    s = _as_int64(seq_lens, "seq_lens")
    if isinstance(lengths, torch.Tensor):
        s = torch.as_tensor(s, device=lengths.device)
    if cp_size == 1:
        out = s
    else:
        h = chunk_length(lengths, cp_size)
        first_chunk, second_chunk = rank_chunks(cp_size, cp_rank)
        first = (s - first_chunk * h).clip(0)
        second = (s - second_chunk * h).clip(0)
        out = first.clip(None, h) + second.clip(None, h) if not isinstance(h, torch.Tensor) else (
            torch.minimum(first, h) + torch.minimum(second, h)
        )
    return out.to(torch.int32) if isinstance(out, torch.Tensor) else torch.from_numpy(out.astype(np.int32))


# ---------------------------------------------------------------------------- vision tokens of a shard
# Where a CP rank's vision tokens sit (family-agnostic: only mm_token_type_ids is read).
# Contract: the vision encoder runs on the whole pack's ``pixel_values`` /
# ``pixel_values_videos`` (every rank, or one rank and a broadcast), and its
# embeddings are scattered into the *global* stream (row ``j`` of the
# concatenated image embeddings goes to the ``j``-th image token of the stream)
# **before** the CP split. A rank then needs only the rows of its own tokens:
#
#     local_embeds[shard.token_extras["mm_token_type_ids"] == 1] = image_embeds[shard.extras["image_embed_index"]]
#
# or, equivalently, gather the global stream at ``vision_token_positions``.

VISION_SHARD_KEYS = ("vision_token_positions", "image_embed_index", "video_embed_index")


def vision_shard_extras(mm_token_type_ids: torch.Tensor, index: torch.Tensor) -> dict:
    """Per-rank vision positions for a shard that keeps stream positions ``index``.

    Args:
        mm_token_type_ids: int ``[T]`` of the whole batch (0 text, 1 image, 2 video; 3 audio in an omni batch).
        index: int64 ``[T / cp]`` the rank's stream positions (``partition_indices``).

    Returns:
        ``vision_token_positions``: int64, global stream positions of the rank's image
        and video tokens (and audio tokens), in local order; ``image_embed_index`` / ``video_embed_index``
        (and ``audio_embed_index`` when the batch has audio tokens):
        int64, for each local image / video / audio token (local order), its row in the
        concatenated image / video / audio embeddings.
    """
    types = mm_token_type_ids.to(index.device)
    local = types[index]
    out = {"vision_token_positions": index[local != 0]}
    kinds = [(1, "image_embed_index"), (2, "video_embed_index")]
    if bool((types == 3).any()):  # an omni batch (thdpack.vlm.omni): its audio tokens too
        kinds.append((3, "audio_embed_index"))
    for kind, key in kinds:
        ordinal = torch.cumsum((types == kind).to(torch.int64), 0) - 1  # row of each token of this kind
        out[key] = ordinal[index][local == kind]
    return out
