"""Log-probabilities of a packed batch's targets, per token and per sample, chunked over the stream
(``[T, V]`` logits never upcast whole), and the checks every loss makes of its batch and logits."""

from __future__ import annotations

import torch

from thdpack.batching.batch import ThdBatch
from thdpack.common.align import check_int
from thdpack.common.values import sample_ids

DEFAULT_CHUNK = 1024  # rows of [T, V] logits upcast and exponentiated at a time


def token_logps(logits: torch.Tensor, batch, *, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Log-probability of every target token of the packed stream.

    Computed ``chunk_size`` rows at a time, forward and backward, in ``[chunk, V]`` float
    buffers reused by every chunk (one; two for bf16/fp16 logits, the upcast and the
    ``log_softmax``): never a ``[T, V]`` float32 copy of the logits. Autograd keeps the logits
    themselves and a ``[T]`` log-normaliser, not a ``[T, V]`` log_softmax. The gradient of
    the logits is ``[T, V]`` in their dtype, as always. ``benchmarks/losses.py`` measures it.

    Args:
        logits: ``[T, V]`` or ``[1, T, V]`` the model's logits on ``batch`` (any float
            dtype), ``T = batch.num_padded_tokens`` (a CP shard's local tokens).
        batch: the :class:`~thdpack.ThdBatch` (or CP shard) the logits are for.
        chunk_size: rows per chunk.

    Returns:
        ``[T]`` float (the logits' dtype, at least float32): ``log p(labels[t])`` at target
        positions, 0 elsewhere. Differentiable (once). On a shared-prefix batch (``batch.prefix_tree``)
        ``[N]``: one log-prob per entry of its target table, the unshared batch's targets in order
        (``token_logps(unshared)[unshared.loss_mask]``), as a prefix row scores several samples' tokens.
    """
    logits = _stream_logits(logits, batch)
    check_int(chunk_size, "chunk_size", 1)
    chunk_size = int(chunk_size)
    tree = getattr(batch, "prefix_tree", None)
    if tree is not None:
        rows, labels = tree.target_rows.to(logits.device), tree.target_labels.to(logits.device)
        _check_label_range(labels, torch.ones_like(labels, dtype=torch.bool), logits.shape[1])
        return _ChunkedRowLogps.apply(logits, rows, labels, chunk_size)
    mask = batch.loss_mask.to(logits.device)
    labels = torch.where(mask, batch.labels.to(logits.device), 0)
    _check_label_range(labels, mask, logits.shape[1])
    return _ChunkedTargetLogps.apply(logits, labels, mask, chunk_size)


class _ChunkedTargetLogps(torch.autograd.Function):
    """``[T, V]`` logits, int64 ``[T]`` labels, bool ``[T]`` mask -> ``[T]`` masked target
    log-probs, chunk by chunk in both directions."""

    @staticmethod
    def forward(ctx, logits, labels, mask, chunk_size):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty_like(out)  # log-normaliser of every row, for the backward
        buf = _chunk_buffer(logits, chunk_size, dtype)
        upcast = None if logits.dtype == dtype else _chunk_buffer(logits, chunk_size, dtype)
        for a in range(0, logits.shape[0], chunk_size):
            rows, lab = logits[a : a + chunk_size], labels[a : a + chunk_size, None]
            n = rows.shape[0]
            x = rows if upcast is None else upcast[:n].copy_(rows)  # bf16/fp16: upcast into a reused chunk
            logp = torch.log_softmax(x, -1, out=buf[:n]).gather(1, lab).squeeze(1)
            lse[a : a + chunk_size] = rows.gather(1, lab).squeeze(1).to(dtype) - logp
            out[a : a + chunk_size] = logp
        out.masked_fill_(~mask, 0)
        ctx.save_for_backward(logits, labels, mask, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, labels, mask, lse = ctx.saved_tensors
        g = torch.where(mask, grad_out, 0).to(lse.dtype)
        grad = torch.empty_like(logits)
        buf = _chunk_buffer(logits, ctx.chunk_size, lse.dtype)
        for a in range(0, logits.shape[0], ctx.chunk_size):
            b = a + ctx.chunk_size
            rows = logits[a:b]
            chunk = torch.sub(rows, lse[a:b, None], out=buf[: rows.shape[0]])
            chunk.exp_().mul_(-g[a:b, None])  # d logp / d logits = onehot - softmax
            chunk.scatter_add_(1, labels[a:b, None], g[a:b, None])
            grad[a:b] = chunk
        return grad, None, None, None


class _ChunkedRowLogps(torch.autograd.Function):
    """``[T, V]`` logits, int64 ``[N]`` rows and labels (a row may appear several times, with different
    labels) -> ``[N]`` log-probs ``logits[row, label] − logsumexp(logits[row])``, the log-normalisers
    computed chunk by chunk once per row; the backward adds every entry's one-hot and softmax terms to
    its row, chunk by chunk (a row's softmax weighted by the sum of its entries' gradients)."""

    @staticmethod
    def forward(ctx, logits, rows, labels, chunk_size):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        upcast = None if logits.dtype == dtype else _chunk_buffer(logits, chunk_size, dtype)
        for a in range(0, logits.shape[0], chunk_size):
            chunk = logits[a : a + chunk_size]
            x = chunk if upcast is None else upcast[: chunk.shape[0]].copy_(chunk)
            lse[a : a + chunk_size] = torch.logsumexp(x, -1)
        ctx.save_for_backward(logits, rows, labels, lse)
        ctx.chunk_size = chunk_size
        return logits[rows, labels].to(dtype) - lse[rows]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, rows, labels, lse = ctx.saved_tensors
        g = grad_out.to(lse.dtype)
        row_grad = torch.zeros_like(lse).index_add_(0, rows, g)  # Σ of the gradients of each row's entries
        grad = torch.empty_like(logits)
        buf = _chunk_buffer(logits, ctx.chunk_size, lse.dtype)
        for a in range(0, logits.shape[0], ctx.chunk_size):
            b = a + ctx.chunk_size
            chunk = torch.sub(logits[a:b], lse[a:b, None], out=buf[: logits[a:b].shape[0]])
            chunk.exp_().mul_(-row_grad[a:b, None])  # d logp / d logits = onehot - softmax
            here = (rows >= a) & (rows < b)
            chunk.index_put_((rows[here] - a, labels[here]), g[here], accumulate=True)
            grad[a:b] = chunk
        return grad, None, None, None


def _chunk_buffer(logits: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """One ``[min(chunk, T), V]`` buffer reused by every chunk: a fresh one per chunk costs its
    page faults each time (large CPU allocations go back to the OS when freed)."""
    return torch.empty(min(chunk_size, logits.shape[0]), logits.shape[1], dtype=dtype, device=logits.device)


def sample_sum(values: torch.Tensor, batch) -> torch.Tensor:
    """``[n]`` sum of the per-token ``values`` ``[T]`` over each sample's slots (on a shared-prefix batch:
    of the per-target ``values`` ``[N]`` over each sample's entries of the target table)."""
    tree = getattr(batch, "prefix_tree", None)
    ids = (sample_ids(batch) if tree is None else tree.target_samples).to(values.device)
    return values.new_zeros(batch.num_samples).index_add(0, ids, values)


def sample_target_counts(batch) -> torch.Tensor:
    """int64 ``[n]`` target tokens of each sample (on a CP shard: this rank's part; sum over
    the CP group for the sample's total; on a shared-prefix batch: its entries of the target table)."""
    tree = getattr(batch, "prefix_tree", None)
    if tree is not None:
        return torch.bincount(tree.target_samples, minlength=batch.num_samples)
    ids = sample_ids(batch).to(batch.loss_mask.device)
    return torch.bincount(ids[batch.loss_mask], minlength=batch.num_samples)


def sequence_logps(logits: torch.Tensor, batch, *, chunk_size: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of target log-probabilities per sample.

    Args:
        logits, batch, chunk_size: as in :func:`token_logps`.

    Returns:
        ``(logps, counts)``: float ``[n]`` (differentiable) and int64 ``[n]`` target tokens
        per sample. On a CP shard both are this rank's part: all-reduce (sum) them over
        the CP group to get the whole samples'.
    """
    return sample_sum(token_logps(logits, batch, chunk_size=chunk_size), batch), sample_target_counts(batch)


def check_batch(batch, name: str = "batch") -> None:
    """``TypeError`` unless ``batch`` is a :class:`~thdpack.ThdBatch` (or a CP shard of one)."""
    if not isinstance(batch, ThdBatch):
        raise TypeError(f"{name} must be a thdpack.ThdBatch (build_thd_batch, ThdCollator), got {type(batch).__name__}")


def _stream_logits(logits: torch.Tensor, batch) -> torch.Tensor:
    """``logits`` as ``[T, V]``; ``TypeError`` / ``ValueError`` unless they are a tensor with data that fits
    ``batch``."""
    check_batch(batch)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a float tensor [T, V] or [1, T, V] (the model's output), got "
                        f"{type(logits).__name__}")
    if logits.is_meta:
        raise ValueError("logits are on the meta device (no data); pass the model's logits computed on a real device")
    T = batch.num_padded_tokens
    if logits.dim() == 3 and logits.shape[0] == 1:
        logits = logits[0]
    if logits.dim() != 2 or logits.shape[0] != T or not logits.is_floating_point():
        raise ValueError(
            f"logits have shape {tuple(logits.shape)} and dtype {logits.dtype}; expected float [T, V] or [1, T, V] "
            f"with T = batch.num_padded_tokens = {T}: pass the model's logits for this batch (shard)"
        )
    return logits


def _check_label_range(labels: torch.Tensor, mask: torch.Tensor, vocab: int) -> None:
    bad = mask & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"target label {int(labels[t])} at stream position {t} is outside the logits' vocabulary [0, {vocab}); "
            "the batch and the model disagree on the vocabulary size"
        )
