"""A prefix tree (a rollout trie) on a varlen kernel: every segment's queries against its ancestors' keys.

A varlen kernel (flash-attn, PyTorch's ``varlen_attn``) attends each query sequence to one key sequence of
its own; with ``cu_seqlens_q != cu_seqlens_k`` and causal masking it aligns the diagonal bottom-right (query
``i`` of ``Lq`` sees keys ``j <= i + Lk - Lq``: flash-attn >= 2.1's rule, and torch's, whose varlen and
``causal_lower_right`` paths call the same flash kernel with ``is_causal``). So the tree mask
(:mod:`thdpack.attention.tree_mask`) is one varlen call over *gathered* keys: segment ``d``'s key sequence is
the real tokens of its ancestors, root first, followed by its own padded span, and its query sequence is its
own span::

    segments      P (3) | T (2), parent P | A (1), parent T | B (1), parent P
    queries       0 1 2 | 3 4             | 5               | 6
    keys          0 1 2 | 0 1 2 3 4       | 0 1 2 3 4 5     | 0 1 2 6

Each query sees every ancestor key and its own segment causally, exactly the tree mask; the projections and
MLPs of a shared token still run once (only keys and values are gathered, and ``index_select`` sends every
branch's gradient back to the shared rows). A segment's pad slots see what its last real token sees and
themselves (finite, attended by no real token); a stream's tail after the last segment (``pad_to``) is one
causal sequence of its own.

:func:`varlen_trie` builds the index once per call (:func:`cached_varlen_trie`: one plan per call's tensors,
reused by every layer); :func:`trie_reference` is the exact CPU reference (SDPA per segment with the
bottom-right mask).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from thdpack.attention.tree_mask import ancestor_table, check_tree

_CACHE_SIZE = 8


@dataclass(frozen=True)
class VarlenTrie:
    """The gathered layout of a trie call (:func:`varlen_trie`).

    Attributes:
        cu_q: int32 ``[N+1]`` the query sequences (non-empty segments, then a tail), covering ``[0, total)``.
        cu_k: int32 ``[N+1]`` their key sequences in the gathered keys.
        kv_index: int64 ``[K]`` the stream slot of every gathered key (``K = cu_k[-1]``).
        max_q, max_k: the longest query / key sequence.
        total: stream slots ``T``.
        spans_q, spans_k: ``cu_q`` / ``cu_k`` as Python tuples (the CPU reference reads them).
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    kv_index: torch.Tensor
    max_q: int
    max_k: int
    total: int
    spans_q: tuple[int, ...]
    spans_k: tuple[int, ...]


def varlen_trie(cu_seqlens_padded, seq_lens, parents, total: int | None = None, *, device=None) -> VarlenTrie:
    """The gathered layout of a trie (the module docstring), validated (:func:`check_tree`).

    Args:
        cu_seqlens_padded: int ``[S+1]`` padded segment offsets.
        seq_lens: int ``[S]`` real tokens of each segment.
        parents: int ``[S]`` parent segment of each, ``-1`` for a root.
        total: the stream length ``T`` (default ``cu_seqlens_padded[-1]``; more: a tail sequence).
        device: where the index tensors live (default: the offsets').
    """
    cu, lens, par, total = check_tree(cu_seqlens_padded, seq_lens, parents, total)
    if device is not None:
        cu, lens, par = cu.to(device), lens.to(device), par.to(device)
    anc, depth = ancestor_table(par)  # [S, D + 1]: anc[s, depth[s]] == s
    span = cu[1:] - cu[:-1]
    keep = torch.nonzero(span > 0).reshape(-1)  # empty segments have no queries
    anc, depth = anc[keep], depth[keep]
    column = torch.arange(anc.shape[1], device=cu.device)[None, :]
    own = column == depth[:, None]
    piece = anc >= 0
    safe = anc.clamp_min(0)
    sizes = torch.where(piece, torch.where(own, span[safe], lens[safe]), 0)  # ancestors: real tokens; own: span
    per_segment = sizes.sum(1)
    starts, sizes = cu[:-1][safe][piece], sizes[piece]  # row-major: a segment's ancestors root first, then itself
    tail = total - int(cu[-1])
    if tail > 0:
        starts = torch.cat([starts, cu[-1:]])
        sizes = torch.cat([sizes, sizes.new_tensor([tail])])
        per_segment = torch.cat([per_segment, per_segment.new_tensor([tail])])
    kv_index = _ranges(starts, sizes)
    q_lens = torch.cat([span[keep], span.new_tensor([tail] if tail > 0 else [])])
    cu_q = _offsets(q_lens)
    cu_k = _offsets(per_segment)
    spans_q, spans_k = tuple(cu_q.tolist()), tuple(cu_k.tolist())
    max_q = max((b - a for a, b in zip(spans_q, spans_q[1:])), default=0)
    max_k = max((b - a for a, b in zip(spans_k, spans_k[1:])), default=0)
    return VarlenTrie(cu_q.to(torch.int32), cu_k.to(torch.int32), kv_index, max_q, max_k, int(total),
                      spans_q, spans_k)


def _ranges(starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """int64: ``starts[i] + 0 .. sizes[i] - 1`` for every ``i``, concatenated."""
    n = int(sizes.sum())
    begin = torch.cumsum(sizes, 0) - sizes
    return torch.repeat_interleave(starts - begin, sizes, output_size=n) + torch.arange(n, device=starts.device)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int64)


_cache: list[tuple[tuple, VarlenTrie]] = []


def cached_varlen_trie(cu_seqlens_padded, seq_lens, parents, total: int, device) -> VarlenTrie:
    """:func:`varlen_trie`, built once per call: every attention layer of a forward gets the same offset,
    length and parent tensors (a call's keywords), so the plan is kept for those tensor objects (weakly, a few
    calls at most) while none of them has been written to."""
    tensors = (cu_seqlens_padded, seq_lens, parents)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return varlen_trie(cu_seqlens_padded, seq_lens, parents, total, device=device)
    key = tuple((id(t), t._version) for t in tensors) + (int(total), torch.device(device))
    for i, (entry, plan) in enumerate(_cache):
        refs, entry_key = entry
        if entry_key == key and all(r() is t for r, t in zip(refs, tensors)):
            return plan
    plan = varlen_trie(cu_seqlens_padded, seq_lens, parents, total, device=device)
    _cache.insert(0, ((tuple(weakref.ref(t) for t in tensors), key), plan))
    del _cache[_CACHE_SIZE:]
    return plan


def gather_keys(key: torch.Tensor, value: torch.Tensor, trie: VarlenTrie) -> tuple[torch.Tensor, torch.Tensor]:
    """``key``, ``value`` (``[T, heads, d]``) gathered into the trie's key sequences: ``[K, heads, d]``."""
    index = trie.kv_index.to(key.device)
    return key.index_select(0, index), value.index_select(0, index)


def trie_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, trie: VarlenTrie, scale: float) -> torch.Tensor:
    """The exact reference of the varlen call: ``q`` ``[T, heads, d]``, ``k``, ``v`` gathered (:func:`gather_keys`,
    ``[K, heads_kv, d]``); each query sequence through SDPA with the bottom-right causal mask (query ``i`` sees
    keys ``j <= i + Lk - Lq``; SDPA's own ``is_causal`` is top-left, so the mask is built). ``[T, heads, d]``."""
    outs = []
    gqa = k.shape[1] != q.shape[1]
    for (a, b), (c, e) in zip(zip(trie.spans_q, trie.spans_q[1:]), zip(trie.spans_k, trie.spans_k[1:])):
        qs, ks, vs = (t[x:y].transpose(0, 1).unsqueeze(0) for t, x, y in ((q, a, b), (k, c, e), (v, c, e)))
        lq, lk = b - a, e - c
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                   enable_gqa=gqa)[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)
