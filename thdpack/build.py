"""Build a THD batch straight from samples: one pass into preallocated arrays,
no ``[B, S]`` padded intermediate, no remove-padding step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from thdpack.align import resolve_pad_multiple, round_up
from thdpack.batch import ThdBatch
from thdpack.samples import get_field, to_int_array

_INT32_MAX = np.iinfo(np.int32).max


def build_thd_batch(
    samples: Sequence,
    *,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    cp_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    pad_multiple: int | None = None,
    max_length: int | None = None,
    pad_to: int | None = None,
    sample_index: Sequence[int] | None = None,
) -> ThdBatch:
    """Pack ``samples`` into one :class:`ThdBatch`.

    Args:
        samples: mappings with ``input_ids`` (``[s]`` integers >= 0) and optionally
            ``labels`` (``[s]``, HF style: unshifted, ``ignore_index`` = no loss) and/or
            ``loss_mask`` (``[s]``, 1 = the token is a target). Without either, every
            token but the first is a target. Lists, numpy arrays, torch tensors and
            Arrow values are accepted.
        pad_token_id: fills alignment pad slots of ``input_ids``.
        ignore_index: label value of non-targets.
        cp_size, tp_size, sequence_parallel: each sample is padded to the least
            multiple these need (:func:`thdpack.cp_pad_multiple`).
        pad_multiple: an extra multiple (e.g. 16 for FP8), combined by lcm.
        max_length: truncate each sample to its first ``max_length`` tokens
            (counted in ``batch.tokens_truncated``).
        pad_to: pad the whole stream to exactly this many tokens (static shapes,
            CUDA graphs) by extending the last sample's padded span; must be a
            multiple of the pad multiple and at least the aligned total. Real
            ``cu_seqlens`` are unchanged.
        sample_index: ``[n]`` input row of each sample, recorded in the batch
            (defaults to ``0..n-1``).

    Returns:
        A :class:`ThdBatch` on the CPU.
    """
    if isinstance(samples, Mapping):
        raise ValueError("build_thd_batch expects a sequence of samples, got a single mapping")
    samples = list(samples)
    if not samples:
        raise ValueError("build_thd_batch got no samples; a batch needs at least one")
    multiple = resolve_pad_multiple(cp_size, tp_size, sequence_parallel, pad_multiple)
    if max_length is not None and (isinstance(max_length, bool) or int(max_length) < 1):
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")

    ids_parts, label_parts, mask_parts, tokens_truncated = _read_samples(samples, max_length)
    seq_lens = np.fromiter((p.size for p in ids_parts), dtype=np.int64, count=len(ids_parts))

    cu = np.zeros(len(seq_lens) + 1, dtype=np.int64)
    np.cumsum(seq_lens, out=cu[1:])
    padded = round_up(seq_lens, multiple)
    if pad_to is not None:
        padded = _extend_last(padded, pad_to, multiple)
    cu_padded = np.zeros_like(cu)
    np.cumsum(padded, out=cu_padded[1:])
    total = int(cu_padded[-1])
    if total > _INT32_MAX:
        raise ValueError(f"pack of {total} tokens does not fit int32 cu_seqlens")

    ids = _concat(ids_parts)
    _check_ids(ids, cu)
    source = ids if label_parts is None else _concat(label_parts)
    if label_parts is not None:
        _check_labels(source, cu, ignore_index)
    if mask_parts is not None:
        mask = _concat(mask_parts)
        _check_mask(mask, cu)
        source = np.where(mask.astype(bool), source, ignore_index)

    # targets: token t predicts token t+1 of the same sample; a sample's last token predicts nothing
    targets = np.empty(ids.size, dtype=np.int64)
    targets[:-1] = source[1:]
    targets[cu[1:] - 1] = ignore_index

    if multiple == 1:
        input_ids, labels = ids, targets
    else:
        dest = np.arange(ids.size, dtype=np.int64) + np.repeat(cu_padded[:-1] - cu[:-1], seq_lens)
        input_ids = np.full(total, pad_token_id, dtype=np.int64)
        input_ids[dest] = ids
        labels = np.full(total, ignore_index, dtype=np.int64)
        labels[dest] = targets
    position_ids = np.arange(total, dtype=np.int64) - np.repeat(cu_padded[:-1], padded)

    if sample_index is None:
        index = torch.arange(len(samples), dtype=torch.int64)
    else:
        index = torch.as_tensor(np.asarray(sample_index, dtype=np.int64))
        if index.numel() != len(samples):
            raise ValueError(f"sample_index has {index.numel()} entries for {len(samples)} samples")
    labels_t = torch.from_numpy(labels)
    return ThdBatch(
        input_ids=torch.from_numpy(input_ids),
        labels=labels_t,
        loss_mask=labels_t != ignore_index,
        position_ids=torch.from_numpy(position_ids),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        cu_seqlens_padded=torch.from_numpy(cu_padded.astype(np.int32)),
        max_seqlen=int(padded.max()),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        sample_index=index,
        pad_multiple=multiple,
        ignore_index=ignore_index,
        tokens_truncated=tokens_truncated,
    )


def _read_samples(samples, max_length):
    """Per-sample 1-D arrays of ids, labels (or None), loss masks (or None), and
    the number of tokens cut by ``max_length``."""
    ids_parts, label_parts, mask_parts = [], [], []
    truncated = 0
    any_labels = any_mask = False
    for i, sample in enumerate(samples):
        ids = to_int_array(get_field(sample, "input_ids", i, required=True), sample=i, field="input_ids")
        if ids.size == 0:
            raise ValueError(f"sample {i}: 'input_ids' is empty; every sample needs at least one token")
        labels = get_field(sample, "labels", i)
        mask = get_field(sample, "loss_mask", i)
        if labels is not None:
            labels = _same_length(to_int_array(labels, sample=i, field="labels"), ids, i, "labels")
            any_labels = True
        if mask is not None:
            mask = _same_length(to_int_array(mask, sample=i, field="loss_mask"), ids, i, "loss_mask")
            any_mask = True
        if max_length is not None and ids.size > max_length:
            truncated += ids.size - max_length
            ids = ids[:max_length]
            labels = None if labels is None else labels[:max_length]
            mask = None if mask is None else mask[:max_length]
        ids_parts.append(ids)
        label_parts.append(labels)
        mask_parts.append(mask)
    if any_labels:
        label_parts = [ids if lab is None else lab for lab, ids in zip(label_parts, ids_parts)]
    if any_mask:
        mask_parts = [np.ones(ids.size, bool) if m is None else m for m, ids in zip(mask_parts, ids_parts)]
    return ids_parts, label_parts if any_labels else None, mask_parts if any_mask else None, truncated


def _extend_last(padded: np.ndarray, pad_to, multiple: int) -> np.ndarray:
    aligned_total = int(padded.sum())
    if isinstance(pad_to, bool) or not isinstance(pad_to, (int, np.integer)) or pad_to % multiple:
        raise ValueError(f"pad_to must be an integer multiple of the pad multiple {multiple}, got {pad_to!r}")
    if pad_to < aligned_total:
        raise ValueError(f"pad_to={pad_to} is shorter than the pack ({aligned_total} tokens after alignment)")
    padded = padded.copy()
    padded[-1] += pad_to - aligned_total
    return padded


def _same_length(arr: np.ndarray, ids: np.ndarray, index: int, field: str) -> np.ndarray:
    if arr.size != ids.size:
        raise ValueError(f"sample {index}: '{field}' has {arr.size} values but 'input_ids' has {ids.size}")
    return arr


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    out = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out.astype(np.int64, copy=len(parts) == 1)


def _sample_of(position: int, cu: np.ndarray) -> int:
    return int(np.searchsorted(cu, position, side="right") - 1)


def _check_ids(ids: np.ndarray, cu: np.ndarray) -> None:
    if ids.min() < 0:
        t = int(np.argmax(ids < 0))
        i = _sample_of(t, cu)
        raise ValueError(f"sample {i}: 'input_ids' has negative id {int(ids[t])} at token {t - int(cu[i])}")


def _check_labels(labels: np.ndarray, cu: np.ndarray, ignore_index: int) -> None:
    bad = (labels < 0) & (labels != ignore_index)
    if bad.any():
        t = int(np.argmax(bad))
        i = _sample_of(t, cu)
        raise ValueError(
            f"sample {i}: 'labels' has {int(labels[t])} at token {t - int(cu[i])}; "
            f"labels must be token ids >= 0 or ignore_index ({ignore_index})"
        )


def _check_mask(mask: np.ndarray, cu: np.ndarray) -> None:
    bad = (mask != 0) & (mask != 1)
    if bad.any():
        t = int(np.argmax(bad))
        i = _sample_of(t, cu)
        raise ValueError(f"sample {i}: 'loss_mask' has {mask[t]!r} at token {t - int(cu[i])}; expected 0 or 1")
