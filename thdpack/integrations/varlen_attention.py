"""PyTorch's own varlen flash kernel as a transformers attention backend: packed attention at flash speed with
nothing to compile and no ``flash-attn`` build.

:func:`register_varlen_attention` registers :data:`VARLEN_ATTENTION` in transformers' ``AttentionInterface``
(with transformers' flash mask function, so no ``[T, T]`` mask is ever built) and returns the name to pass as
``attn_implementation``. The attention function reads the offsets every packed batch carries
(``to_hf_kwargs(ThdBatch)``: ``cu_seq_lens_q/k`` int32 ``[n+1]``, ``max_length_q/k``) and

- on CUDA in float16 / bfloat16 calls ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10): causal or not,
  sliding windows, GQA, the module's softmax scale, static offsets (zero-length sequences at the end); torch
  2.11's signature (``is_causal``) and 2.13's (``window_size``, ``enable_gqa``) alike;
- elsewhere (the CPU, float32) runs an exact reference: SDPA on each sample alone, so the same model runs in CI.

Called without offsets (a vision tower's per-image calls, a plain unpacked batch) each batch row is one sequence.
A rollout trie / shared-prefix tree (``to_hf_kwargs(tree, attn_implementation=name)``: ``segment_lens`` and
``segment_parents`` beside the segments' offsets) runs as one varlen call over gathered keys: each segment's
queries against its ancestors' real keys and values, then its own, causal bottom-right
(:mod:`thdpack.attention.trie_varlen`; the index built once per call, the CPU reference SDPA per segment), so
the shared tokens' projections and MLPs still run once.

What neither path can do is refused by name: attention dropout (the kernel has none), a padding
``attention_mask`` (pack the batch instead), a trie on a sliding-window or non-causal layer.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from thdpack.attention.backends import VARLEN_ATTENTION
from thdpack.attention.trie_varlen import cached_varlen_trie, gather_keys, trie_reference

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def register_varlen_attention() -> str:
    """Register :data:`VARLEN_ATTENTION` in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``
    (idempotent) and return the name, for ``from_pretrained(..., attn_implementation=name)`` /
    ``model.set_attn_implementation(name)`` and ``to_hf_kwargs(batch, attn_implementation=name)``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, flash_attention_mask)
    return VARLEN_ATTENTION


def varlen_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                             scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function (``AttentionInterface``).

    Args:
        query: ``[b, h, s, d]``; key, value: ``[b, h_kv, s, d]`` (``h`` a multiple of ``h_kv``). With offsets,
            ``b`` is 1 and ``s`` the stream.
        attention_mask: None (a padding mask is refused: pack the batch).
        scaling: the softmax scale (None: ``d ** -0.5``).
        dropout: must be 0.
        sliding_window: a layer's window ``w`` (a token sees itself and the ``w - 1`` before it), or None.
        kwargs: ``cu_seq_lens_q/k`` (int32 ``[n+1]``) and ``max_length_q/k`` of the packed batch, ``is_causal``.

    Returns:
        ``(out, None)``: ``out`` ``[b, s, h, d]`` in the query's dtype.
    """
    if dropout:
        raise ValueError(f"attn_implementation={VARLEN_ATTENTION!r} has no attention dropout (torch's varlen_attn "
                         f"has none), got dropout={dropout}: set the config's attention_dropout to 0")
    if attention_mask is not None:
        raise ValueError(f"attn_implementation={VARLEN_ATTENTION!r} reads sample boundaries from cu_seq_lens_q/k, "
                         "not an attention_mask: pass a packed batch (thdpack.integrations.to_hf_kwargs) without "
                         "padding")
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    b, h, s, d = query.shape
    if kwargs.get("segment_lens") is not None or kwargs.get("segment_parents") is not None:
        return _trie_attention(query, key, value, scaling, causal, sliding_window, kwargs), None
    if cu_q is None:  # no offsets: each row of the batch is one sequence
        cu_q = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)
        max_q = s
        query, key, value = (t.transpose(1, 2).reshape(1, b * s, t.shape[1], d).transpose(1, 2)
                             for t in (query, key, value))
    else:
        if b != 1:
            raise ValueError(f"attn_implementation={VARLEN_ATTENTION!r} with cu_seq_lens_q takes one packed "
                             f"stream (batch size 1), got batch size {b}")
        if cu_k is not None and not torch.equal(cu_k, cu_q):
            raise ValueError(f"attn_implementation={VARLEN_ATTENTION!r}: cu_seq_lens_k must equal cu_seq_lens_q "
                             "(self-attention on a packed stream)")
        max_q = int(kwargs.get("max_length_q") or s)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, d]
    scale = d ** -0.5 if scaling is None else float(scaling)
    window = None if sliding_window is None or not causal else int(sliding_window)
    if q.is_cuda and q.dtype in _KERNEL_DTYPES and _kernel_takes(window):
        out = _varlen_kernel(q, k, v, cu_q.to(torch.int32), max_q, scale, causal, window)
    else:
        out = _reference(q, k, v, cu_q, scale, causal, window)
    out = out.reshape(b, s, h, d) if b > 1 else out.unsqueeze(0)
    return out, None


def _trie_attention(query, key, value, scaling, causal: bool, sliding_window, kwargs) -> torch.Tensor:
    """A rollout trie's call (``segment_lens`` / ``segment_parents`` with ``cu_seq_lens_q``): each segment's queries
    against its ancestors' real keys and its own, causal bottom-right (:mod:`thdpack.attention.trie_varlen`; the
    gather index is built once per call). ``[1, T, h, d]``."""
    lens, parents, cu = kwargs.get("segment_lens"), kwargs.get("segment_parents"), kwargs.get("cu_seq_lens_q")
    if lens is None or parents is None or cu is None:
        raise ValueError(f"attn_implementation={VARLEN_ATTENTION!r}: a trie call needs cu_seq_lens_q, segment_lens "
                         "and segment_parents together; pass to_hf_kwargs(batch) of a shared-prefix batch")
    b, h, s, d = query.shape
    if b != 1:
        raise ValueError(f"attn_implementation={VARLEN_ATTENTION!r}: a trie call takes one packed stream (batch "
                         f"size 1), got batch size {b}")
    if not causal or sliding_window is not None:
        raise ValueError(f"attn_implementation={VARLEN_ATTENTION!r}: a trie's segments attend to their ancestors "
                         f"causally and whole; a {'sliding-window' if causal else 'non-causal'} layer cannot read "
                         "them: build the batch with share_prefix=None (the unshared layout)")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and not torch.equal(cu_k, cu):
        raise ValueError(f"attn_implementation={VARLEN_ATTENTION!r}: cu_seq_lens_k must equal cu_seq_lens_q "
                         "(the trie's segments)")
    trie = cached_varlen_trie(cu, lens, parents, s, query.device)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, d]
    k, v = gather_keys(k, v, trie)  # [K, heads_kv, d]: every segment's ancestors, then itself
    scale = d ** -0.5 if scaling is None else float(scaling)
    if q.is_cuda and q.dtype in _KERNEL_DTYPES and _kernel_takes(None):
        out = _varlen_kernel(q, k, v, trie.cu_q, trie.max_q, scale, True, None, cu_k=trie.cu_k, max_k=trie.max_k)
    else:
        out = trie_reference(q, k, v, trie, scale)
    return out.unsqueeze(0)


def _kernel_signature() -> set[str]:
    from torch.nn.attention.varlen import varlen_attn

    return set(inspect.signature(varlen_attn).parameters)


def _kernel_takes(window: int | None) -> bool:
    """Whether the installed ``varlen_attn`` can run this call itself (torch 2.11's has no window: the reference
    runs it; without ``enable_gqa`` the key / value heads are repeated)."""
    try:
        params = _kernel_signature()
    except ImportError:  # torch < 2.10
        return False
    return window is None or "window_size" in params


def _varlen_kernel(q, k, v, cu, max_len: int, scale: float, causal: bool, window: int | None, *, cu_k=None,
                   max_k: int | None = None) -> torch.Tensor:
    """``varlen_attn`` on ``[T, heads, d]`` tensors, in either signature; ``cu_k`` / ``max_k`` the key sequences
    where they differ from the queries' (a trie's gathered keys: causal is then bottom-right aligned)."""
    from torch.nn.attention.varlen import varlen_attn

    params = _kernel_signature()
    if k.shape[1] != q.shape[1] and "enable_gqa" not in params:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    options = {"scale": scale}
    if "window_size" in params:
        options["window_size"] = ((-1 if window is None else window - 1), 0) if causal else (-1, -1)
        if k.shape[1] != q.shape[1]:
            options["enable_gqa"] = True
    else:
        options["is_causal"] = causal
    cu_k, max_k = (cu, max_len) if cu_k is None else (cu_k, max_k)
    return varlen_attn(q, k, v, cu, cu_k, max_len, max_k, **options)


def _reference(q, k, v, cu, scale: float, causal: bool, window: int | None) -> torch.Tensor:
    """Exact attention of each sample alone: SDPA per ``[a, b)`` of the offsets (zero-length ones skipped);
    ``[T, heads, d]`` in, the same out. Only a sample's own ``[L, L]`` window mask is ever built."""
    out = torch.zeros_like(q)
    offsets = cu.tolist()
    gqa = k.shape[1] != q.shape[1]
    for a, b in zip(offsets[:-1], offsets[1:]):
        if b <= a:
            continue
        qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, L, d]
        mask = None
        if window is not None:
            i = torch.arange(b - a, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal and mask is None,
                                                  scale=scale, enable_gqa=gqa)[0].transpose(0, 1)
    return out
