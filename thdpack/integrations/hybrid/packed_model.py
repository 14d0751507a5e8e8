"""``packed_model(model)``: a transformers model exact on thdpack packs on any machine, hybrids included.

Linear-attention, SSM and short-convolution layers keep packed samples apart only through their kernels
(flash-linear-attention, causal-conv1d, mamba-ssm), which run on CUDA only; on the CPU, or where a package
is missing, transformers refuses the boundaries (>= 5.25) or, in older versions, drops some of them
silently. :func:`packed_model` wraps each such layer (the instance's ``forward``; no model source is edited
and no global state changes) so that, when the call carries sample boundaries (``cu_seq_lens_q`` /
``seq_idx``, as :func:`thdpack.integrations.to_hf_kwargs` gives them), the layer runs on each sample's span
alone (the reference path: the model's own PyTorch code on exactly what the sample alone would see) and
the outputs are concatenated. Where every kernel the layer needs is present and runs on the inputs' device,
and transformers is a version checked to pass them the boundaries (:data:`NATIVE_SINCE`), the layer is
left to transformers' kernels.

A forward pre-hook on the model (every model, hybrid or not) gives a packed call without an ``attention_mask``
the document mask its attention backend reads (so ``to_hf_kwargs()`` without ``attn_implementation`` is exact
on an sdpa / eager / flex model too, under its ``use_cache`` default), and checks every packed call of a hybrid: ``seq_idx`` and ``cu_seq_lens_q`` agree, the
stream's positions restart at 0 at every boundary (a CP shard's chunks or a shared-prefix tree cannot be
scanned as samples: refused), and a packed ``position_ids`` row without boundaries is refused rather than
scanned as one sequence. On a full-attention model such a row is made exact instead (transformers' own
packed-sequence masks, or offsets for varlen backends: :func:`_pack_from_restarts`) or refused; it never
attends across the samples. For models with sliding-window or chunked attention layers it drops a 4D
whole-stream mask and sets ``use_cache=False``, so transformers derives every layer type's mask from the
restarting ``position_ids`` (a document mask has no window). A ``BlockMask`` handed to a hybrid model goes in
as a per-layer-type dict (transformers 5.25's recurrent-layer mask cannot read a ``BlockMask``).
"""

from __future__ import annotations

import functools
import importlib.util
import types

import torch

from thdpack.attention.backends import VARLEN_ATTENTION, attention_kind, dense_mask_dtype
from thdpack.attention.block_mask import document_block_mask
from thdpack.attention.dense_mask import dense_document_mask
from thdpack.attention.documents import document_ids_from_offsets
from thdpack.attention.tree_mask import dense_tree_mask, tree_block_mask
from thdpack.batching.prefix_tree import SHARED_LAYOUT_HINT
from thdpack.integrations.hybrid.state_forks import TrieCall, check_trie_positions, run_trie
from thdpack.integrations.hybrid.mixers import (
    ATTENTION_LAYER_TYPES,
    MIXER_FAMILIES,
    WINDOWED_LAYER_TYPES,
    config_layer_types,
)

TRIE_KEYS = ("segment_lens", "segment_parents")  # a trie call's segments (to_hf_kwargs of a shared-prefix batch)
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx") + TRIE_KEYS
CACHE_KEYS = ("cache", "cache_params", "past_key_values", "past_key_value")
NATIVE_SINCE = (5, 25)  # transformers versions checked to hand the kernels seq_idx / cu_seqlens (docs/hybrid.md)


class _PackedState:
    """What a prepared model's hook and its mixers share: the spans of the current packed call (for mixers that
    get no keywords) and what the model is. Stored on the model and on each mixer (one object), so a
    ``copy.deepcopy`` of the model gets its own."""

    def __init__(self, has_mixers: bool, windowed: bool, layer_types: set):
        self.spans: list[tuple[int, int]] | None = None
        self.trie: TrieCall | None = None
        self.has_mixers, self.windowed, self.layer_types = has_mixers, windowed, layer_types


def packed_model(model):
    """Make a transformers model exact on packed batches (:func:`thdpack.integrations.to_hf_kwargs`) on any
    machine, and return it. Idempotent.

    - every model: a packed call (``cu_seq_lens_q`` / ``seq_idx``) without an ``attention_mask`` gets the
      document mask its ``config._attn_implementation`` reads (sdpa / eager / flex), so even
      ``to_hf_kwargs()`` without ``attn_implementation`` is exact under the config's ``use_cache``;
    - hybrid models: each sequence-mixing layer runs per sample where kernels cannot keep samples apart
      (the module docstring), and every packed call is checked.

    - every model: a call whose ``position_ids`` restart inside a row but that carries no boundaries is made
      exact (the samples found where the positions restart) or refused, never run across the samples
      (:func:`_without_boundaries`).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: the model has a sequence-mixing layer or a config layer type that no registered family
            (:mod:`thdpack.integrations.hybrid.mixers`) describes: named, not guessed.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"packed_model takes a transformers model (a torch.nn.Module, such as "
                        f"AutoModelForCausalLM.from_pretrained(...)), got {type(model).__name__}")
    if getattr(model, "_thdpack_packed_model", False):
        return model
    config = getattr(model, "config", None)
    layer_types = set(config_layer_types(config)) if config is not None else set()
    mixers = [(name, module) for name, module in model.named_modules() if type(module).__name__ in MIXER_FAMILIES]
    _refuse_unknown(model, layer_types, mixers)
    windowed = bool(layer_types & WINDOWED_LAYER_TYPES) or _has_sliding_window(config)
    state = _PackedState(bool(mixers), windowed, layer_types)
    model._thdpack_state = state
    for name, module in mixers:
        module._thdpack_state = state
        module._thdpack_name = name
        inner = module.__dict__.get("forward")  # an instance-level forward (accelerate hooks) stays inside
        module._thdpack_inner_forward = inner
        module.forward = types.MethodType(_per_sample_forward, module)
    model.register_forward_pre_hook(_before_forward, with_kwargs=True)
    model._thdpack_packed_model = True
    return model


# --------------------------------------------------------------------------- the model's pre-hook


def _before_forward(module, args, kwargs):
    """Check a packed call, give it the mask its attention reads, and hand the mixers its spans."""
    state: _PackedState = module._thdpack_state
    cu, seq_idx, positions = kwargs.get("cu_seq_lens_q"), kwargs.get("seq_idx"), kwargs.get("position_ids")
    state.spans, state.trie = None, None
    if any(kwargs.get(key) is not None for key in TRIE_KEYS):
        return _trie_call(module, state, args, kwargs)
    if cu is None and seq_idx is None:
        return _without_boundaries(module, state, args, kwargs)
    spans = spans_of(cu, seq_idx)
    given = kwargs
    if state.has_mixers:
        row = text_row(positions) if positions is not None else None
        if row is not None:
            check_positions_restart(row, spans)
        state.spans = spans
        kwargs = _with_both_boundaries(kwargs, spans)
    mask = kwargs.get("attention_mask")
    if state.windowed:
        if mask is None or _is_whole_stream_mask(kwargs):
            # transformers derives each layer type's mask (windows included) from the restarting position_ids
            return args, dict({k: v for k, v in kwargs.items() if k != "attention_mask"}, use_cache=False)
        return None if kwargs is given else (args, kwargs)
    if mask is None:
        mask = _document_mask(module, kwargs, spans)
        if mask is None:
            return None if kwargs is given else (args, kwargs)
    if state.has_mixers and not isinstance(mask, (torch.Tensor, dict)):
        # a BlockMask: transformers 5.25's recurrent-layer mask reads attention_mask.ndim, which it lacks;
        # hybrid models take their masks per layer type, the recurrent layers' None (they read seq_idx)
        mask = _per_layer_type(mask, state.layer_types)
    return args, dict(kwargs, attention_mask=mask)


def _trie_call(model, state: _PackedState, args, kwargs):
    """A trie call (``segment_lens`` / ``segment_parents`` with ``cu_seq_lens_q``): checked, its keys taken off (the
    model never sees them) unless the attention backend is ``thdpack_varlen``, which gathers each segment's
    ancestors by them (the mixers drop them), the tree mask given where the call has none and the backend reads
    one, and the segments handed to the mixers, which fork their states
    (:mod:`thdpack.integrations.hybrid.state_forks`)."""
    name = type(model).__name__
    lens, parents, cu = kwargs.get("segment_lens"), kwargs.get("segment_parents"), kwargs.get("cu_seq_lens_q")
    if lens is None or parents is None or cu is None:
        raise ValueError(f"{name}: a trie call needs cu_seq_lens_q, segment_lens and segment_parents together; pass "
                         "to_hf_kwargs(batch) of a shared-prefix batch")
    if state.windowed:
        raise ValueError(f"{name} has sliding-window / chunked attention layers, whose masks transformers derives "
                         f"from the positions, which a trie's branches share: {SHARED_LAYOUT_HINT}")
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation != VARLEN_ATTENTION:
        kwargs = {k: v for k, v in kwargs.items() if k not in TRIE_KEYS}
    total = _stream_length(kwargs)
    trie = TrieCall.from_kwargs(cu, lens, parents, total)
    row = text_row(kwargs["position_ids"]) if kwargs.get("position_ids") is not None else None
    if row is not None:
        check_trie_positions(row, trie)
    state.trie = trie if state.has_mixers else None
    mask = kwargs.get("attention_mask")
    if mask is None:
        mask = _tree_mask(model, trie, kwargs)
    if state.has_mixers and mask is not None and not isinstance(mask, (torch.Tensor, dict)):
        mask = _per_layer_type(mask, state.layer_types)
    return args, dict(kwargs, attention_mask=mask)


def _tree_mask(model, trie: TrieCall, kwargs):
    """The trie's mask for the model's attention backend: a tree ``BlockMask`` (flex) or ``[1, 1, T, T]`` (sdpa /
    eager); None for ``thdpack_varlen`` (it reads the segments from the call); ``ValueError`` for other varlen
    backends, which cannot read ancestors."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation == VARLEN_ATTENTION:
        return None
    kind = attention_kind(implementation)
    if kind == "flash":
        raise ValueError(f"{type(model).__name__}: attn_implementation={implementation!r} (varlen) cannot attend to a "
                         f"trie's ancestors: use 'flex_attention', 'sdpa' or 'eager', {SHARED_LAYOUT_HINT}")
    device = _stream_device(kwargs)
    cu = torch.tensor(trie.offsets, dtype=torch.int64, device=device)
    lens = torch.tensor(trie.lens, dtype=torch.int64, device=device)
    parents = torch.tensor(trie.parents, dtype=torch.int64, device=device)
    if kind == "flex":
        return tree_block_mask(cu, lens, parents, trie.total, device=device)
    return dense_tree_mask(cu, lens, parents, trie.total, dtype=dense_mask_dtype(implementation), device=device)


def _stream_device(kwargs) -> torch.device:
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    return ids.device if ids is not None else embeds.device


def _stream_length(kwargs) -> int:
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    return int(ids.shape[-1] if ids is not None else embeds.shape[1])


def _with_both_boundaries(kwargs: dict, spans: list[tuple[int, int]]) -> dict:
    """``kwargs`` with ``seq_idx`` and ``cu_seq_lens_q/k`` both present (as :func:`to_hf_kwargs` gives them)
    when the call gave one: where the kernels run natively, each reads its own (a Mamba-2 scan or a convolution
    ``seq_idx``, a Gated DeltaNet scan ``cu_seq_lens_q``), and one left out would scan across the samples."""
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("seq_idx") is not None:
        return kwargs
    device = next(v.device for v in kwargs.values() if isinstance(v, torch.Tensor))
    ends = [0] + [b for _, b in spans]
    extra = {}
    if kwargs.get("seq_idx") is None:
        extra["seq_idx"] = document_ids_from_offsets(ends, device=device).to(torch.int32)[None]
    if kwargs.get("cu_seq_lens_q") is None:
        cu = torch.tensor(ends, dtype=torch.int32, device=device)
        longest = max((b - a for a, b in spans), default=0)
        extra.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return dict(kwargs, **extra)


# --------------------------------------------------------------------------- a pack without boundaries


def _without_boundaries(model, state: _PackedState, args, kwargs):
    """A call without ``cu_seq_lens_q`` / ``seq_idx``: left as it is unless its text ``position_ids`` restart
    between two attended tokens of a row (a pack), which transformers masks as one sequence whenever the call
    has a cache (the configs' default ``use_cache=True``), a ``[B, S]`` mask or a varlen backend. Such a call
    is made exact (:func:`_pack_from_restarts`) or refused: a hybrid (its scans would cross the samples), a
    padding mask with pad slots (transformers then ignores the restarts).

    Cost: one host sync where ``position_ids`` are on a GPU (whether a row restarts decides the call; it cannot
    be avoided, and transformers' own packed-sequence test syncs the same way); a plain row (``arange``) costs
    nothing more."""
    mask = kwargs.get("attention_mask")
    padding = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    if mask is not None and padding is None and not state.has_mixers:
        return None  # a 4D mask, BlockMask or per-layer dict: the caller's own, used as it is
    rows = _text_rows(kwargs.get("position_ids"))
    if rows is None or not _restarts_between_attended(rows, padding):
        return None
    name = type(model).__name__
    if state.has_mixers:
        raise ValueError(
            f"{name}: position_ids restart inside the row (a packed batch) but the call "
            "carries no seq_idx / cu_seq_lens_q, so its linear-attention / SSM / convolution layers would "
            "scan the pack as one sequence; pass to_hf_kwargs(batch) (thdpack) or "
            "DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)")
    if padding is not None and not bool(padding.all()):
        raise ValueError(
            f"{name}: position_ids restart between attended tokens of a row (packed samples) and attention_mask "
            "is a [B, S] padding mask with pad slots, with which transformers attends across the samples; pass "
            "a packed batch's boundaries (thdpack: to_hf_kwargs(batch)) and no padding mask")
    return _pack_from_restarts(model, args, kwargs, rows)


def _pack_from_restarts(model, args, kwargs, rows: torch.Tensor):
    """The exact call for packed ``position_ids`` without boundaries (``rows`` int ``[B, T]``; an all-ones
    padding mask is dropped, it says nothing):

    - sdpa / eager / flex (any ``B``): ``use_cache=False``, so transformers finds the samples where the
      positions stop counting up by one (``masking_utils.find_packed_sequence_indices``, its own exact path);
    - varlen backends (flash-attention, ``thdpack_varlen``, hub kernels), one row: ``cu_seq_lens_q/k`` and
      ``max_length_q/k`` found by the same rule (transformers' flash path derives the same offsets itself;
      ``thdpack_varlen`` reads nothing else);
    - ``ValueError`` for a cache to continue, several rows on a varlen backend, or an unknown backend."""
    name = type(model).__name__
    if any(kwargs.get(key) is not None for key in CACHE_KEYS):
        raise ValueError(f"{name}: position_ids restart inside a row (packed samples) of a call that continues a "
                         "cache (past_key_values); a pack is never continued: call it without a cache")
    rest = {k: v for k, v in kwargs.items() if k != "attention_mask"}
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    try:
        kind = attention_kind(implementation)
    except ValueError:
        kind = None
    if kind in ("dense", "flex"):
        return args, dict(rest, use_cache=False)
    if kind == "flash" and rows.shape[0] == 1:
        return args, dict(rest, **_offsets_from_restarts(rows[0]))
    why = f"{rows.shape[0]} rows" if kind == "flash" else f"attn_implementation={implementation!r}"
    raise ValueError(f"{name}: position_ids restart inside a row (packed samples) and the call carries no "
                     f"boundaries; with {why} thdpack cannot keep the samples apart from the positions alone: "
                     "pass one packed row with its boundaries (thdpack: to_hf_kwargs(batch))")


def _offsets_from_restarts(row: torch.Tensor) -> dict:
    """``cu_seq_lens_q/k`` int32 ``[n+1]`` and ``max_length_q/k`` (int) of one packed row of positions (int
    ``[T]``): a sample starts wherever the positions stop counting up by one. One host sync (the starts)."""
    starts = (torch.nonzero(row[1:] != row[:-1] + 1).reshape(-1) + 1).tolist()
    edges = [0] + starts + [row.numel()]
    offsets = torch.tensor(edges, dtype=torch.int32, device=row.device)
    longest = max(b - a for a, b in zip(edges, edges[1:]))
    return {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": longest, "max_length_k": longest}


def _restarts_between_attended(rows: torch.Tensor, padding: torch.Tensor | None) -> bool:
    """Whether a row of positions (int ``[B, T]``) stops counting up by one between two tokens that the padding
    mask (``[B, S]``, ``S >= T``: its last ``T`` columns; None: every token) attends. False for a mask that
    does not fit the rows (transformers reports it)."""
    if rows.shape[-1] < 2:
        return False
    jumps = rows[:, 1:] != rows[:, :-1] + 1
    if padding is not None:
        if padding.shape[-1] < rows.shape[-1] or rows.shape[0] not in (1, padding.shape[0]):
            return False
        attended = padding[:, -rows.shape[-1]:].to(device=rows.device, dtype=torch.bool)
        jumps = jumps & attended[:, 1:] & attended[:, :-1]
    return bool(jumps.any())


def _document_mask(model, kwargs, spans):
    """The document mask the model's attention backend reads (None for varlen backends, which read
    ``cu_seq_lens_q``): a ``BlockMask`` for flex, ``[1, 1, T, T]`` for sdpa (bool) / eager (additive)."""
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    try:
        kind = attention_kind(name)
    except ValueError:
        return None
    if kind == "flash":
        return None
    total = spans[-1][1] if spans else 0
    ids = kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    device = ids.device if ids is not None else embeds.device if embeds is not None else None
    offsets = torch.tensor([0] + [b for _, b in spans], dtype=torch.int64, device=device)
    if kind == "flex":
        return document_block_mask(offsets, total)
    return dense_document_mask(offsets, total, dtype=dense_mask_dtype(name), device=device)


def _per_layer_type(mask, layer_types: set) -> dict:
    """``{layer type: mask}`` as hybrid transformers models take it: ``mask`` for attention, None for the
    recurrent layers (their keys in transformers 5.25: ``linear_attention``, ``conv``, ``mamba``)."""
    types = set(layer_types) | {"full_attention", "attention", "linear_attention", "conv", "mamba"}
    return {t: (mask if t in ATTENTION_LAYER_TYPES else None) for t in types}


def _is_whole_stream_mask(kwargs) -> bool:
    mask = kwargs.get("attention_mask")
    return mask is not None and len(getattr(mask, "shape", ())) == 4


def _has_sliding_window(config) -> bool:
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None and getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            if getattr(cfg, "layer_types", None) is None:
                return True
    return False


def _text_rows(positions) -> torch.Tensor | None:
    """int ``[B, T]``: the text positions of ``position_ids`` (``[B, T]``, or a VLM's ``[4, B, T]``); None for
    mRoPE-only ``[3, B, T]`` rows, which do not restart per sample, and for anything else."""
    if not isinstance(positions, torch.Tensor):
        return None
    if positions.dim() == 3:
        return positions[0] if positions.shape[0] == 4 else None
    return positions if positions.dim() == 2 else None


def text_row(positions: torch.Tensor) -> torch.Tensor | None:
    """int ``[T]``: the text positions of a one-row ``position_ids`` (:func:`_text_rows`); None otherwise."""
    rows = _text_rows(positions)
    return rows[0] if rows is not None and rows.shape[0] == 1 else None


def spans_of(cu, seq_idx) -> list[tuple[int, int]]:
    """The non-empty ``(start, end)`` spans of a packed call, from ``cu_seq_lens_q`` (int ``[k+1]``) and / or
    ``seq_idx`` (int ``[1, T]``); ``ValueError`` when they disagree or are malformed."""
    if cu is not None:
        offsets = [int(v) for v in torch.as_tensor(cu).reshape(-1).tolist()]
        if len(offsets) < 2 or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"cu_seq_lens_q must start at 0 and never decrease, got {offsets[:8]}"
                             f"{' ...' if len(offsets) > 8 else ''}")
        spans = [(a, b) for a, b in zip(offsets, offsets[1:]) if b > a]
        if seq_idx is not None:
            ids = torch.as_tensor(seq_idx).reshape(-1)
            ends = [0] + [b for _, b in spans]
            want = document_ids_from_offsets(ends, device=ids.device).long() if spans else ids[:0].long()
            if ids.numel() != offsets[-1] or not torch.equal(_dense_rank(ids), want):
                raise ValueError(f"seq_idx (length {ids.numel()}) does not give the samples of cu_seq_lens_q "
                                 f"(stream length {offsets[-1]}): pass both from the same to_hf_kwargs(batch)")
        return spans
    ids = torch.as_tensor(seq_idx).reshape(-1)
    if ids.numel() == 0:
        return []
    change = torch.nonzero(ids[1:] != ids[:-1]).reshape(-1) + 1
    if bool((ids[1:] < ids[:-1]).any()):
        raise ValueError("seq_idx must never decrease along the stream (one id per sample, in order)")
    edges = [0] + change.tolist() + [int(ids.numel())]
    return list(zip(edges, edges[1:]))


def _dense_rank(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` renumbered 0, 1, ... in order of first appearance (seq_idx need not start at 0 or be dense)."""
    if ids.numel() == 0:
        return ids.to(torch.int64)
    change = torch.cat([torch.zeros(1, dtype=torch.int64, device=ids.device), (ids[1:] != ids[:-1]).to(torch.int64)])
    return change.cumsum(0)


def check_positions_restart(row: torch.Tensor, spans: list[tuple[int, int]]) -> None:
    """``ValueError`` unless the text positions count 0, 1, ... over every span (a scan restarts there)."""
    total = spans[-1][1] if spans else 0
    if row.numel() != total:
        raise ValueError(f"position_ids cover {row.numel()} tokens, the boundaries {total}")
    if not spans:
        return
    lengths = torch.tensor([b - a for a, b in spans], device=row.device)
    starts = torch.tensor([a for a, _ in spans], device=row.device)
    want = torch.arange(total, device=row.device) - torch.repeat_interleave(starts, lengths)
    if not torch.equal(row.to(want.dtype), want):
        bad = int(torch.nonzero(row.to(want.dtype) != want)[0])
        raise ValueError(
            f"position_ids do not restart at 0 at every sample boundary (slot {bad}): a CP / Ulysses shard's "
            "chunks or a shared-prefix tree cannot be scanned by linear-attention / SSM / convolution layers "
            "sample by sample; run hybrid models on whole, unshared batches, or pass a shared-prefix batch with its "
            "segment_lens and segment_parents (to_hf_kwargs(batch) gives them)")


# --------------------------------------------------------------------------- the mixers


def _per_sample_forward(self, *args, **kwargs):
    """A mixer's forward on a packed call: each sample's span alone (the reference path), unless its kernels
    keep the samples apart themselves (:func:`_native`). Bound to the mixer instance (``types.MethodType``)."""
    run = self._thdpack_inner_forward or functools.partial(type(self).forward, self)
    hidden = args[0] if args else kwargs.get("hidden_states")
    if self._thdpack_state.trie is not None and hidden is not None:
        return _trie_forward(self, run, hidden, args, kwargs)
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("seq_idx") is not None:
        spans = spans_of(kwargs.get("cu_seq_lens_q"), kwargs.get("seq_idx"))
    else:
        spans = self._thdpack_state.spans
    family = MIXER_FAMILIES[type(self).__name__]
    if spans is None or hidden is None or _native(family, hidden.device):
        return run(*args, **kwargs)
    if hidden.dim() != 3 or hidden.shape[0] != 1 or (spans and spans[-1][1] != hidden.shape[1]):
        raise ValueError(f"{self._thdpack_name} ({type(self).__name__}): a packed call has a batch axis of 1 and one "
                         f"stream of {spans[-1][1] if spans else 0} tokens, got hidden states {tuple(hidden.shape)}")
    rest = {k: v for k, v in kwargs.items() if k not in BOUNDARY_KEYS and k != "hidden_states"}
    for key in CACHE_KEYS:
        if key in rest:
            rest[key] = None  # a sample alone, from an empty state; a pack is never continued
    mask = rest.pop("attention_mask", None)
    extra = tuple(None if hasattr(a, "get_seq_length") else a for a in args[1:])
    outputs = []
    for a, b in spans:
        part_mask = mask[:, a:b] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        outputs.append(run(hidden[:, a:b], *extra, attention_mask=part_mask, **rest))
    if isinstance(outputs[0], tuple):  # (hidden, None, ...) where a mixer returns more
        return (torch.cat([o[0] for o in outputs], dim=1),) + outputs[0][1:]
    return torch.cat(outputs, dim=1)


def _trie_forward(self, run, hidden, args, kwargs):
    """A mixer's forward on a trie call: every segment from its parent's final state, on every device (native
    kernels given the segments as sequences would start each from zero)."""
    trie = self._thdpack_state.trie
    if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[1] != trie.total:
        raise ValueError(f"{self._thdpack_name} ({type(self).__name__}): a trie call has a batch axis of 1 and one "
                         f"stream of {trie.total} tokens, got hidden states {tuple(hidden.shape)}")
    if len(args) > 1:
        raise ValueError(f"{self._thdpack_name} ({type(self).__name__}) was called with {len(args)} positional "
                         "arguments; thdpack forks its state only where the cache is passed by keyword")
    rest = {k: v for k, v in kwargs.items()
            if k not in BOUNDARY_KEYS and k not in CACHE_KEYS and k not in ("hidden_states", "attention_mask")}
    return run_trie(run, hidden, trie, rest, continues_state=MIXER_FAMILIES[type(self).__name__].continues_state)


def _native(family, device: torch.device) -> bool:
    """True where transformers' kernels keep the samples apart themselves: CUDA, every package the layers need
    importable, and a transformers version checked to pass them the boundaries."""
    if device.type != "cuda" or family.kernels is None:
        return False
    if not all(importlib.util.find_spec(package) is not None for package in family.kernels):
        return False
    import transformers

    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    return version >= NATIVE_SINCE


def _refuse_unknown(model, layer_types: set, mixers: list) -> None:
    """``ValueError`` naming a sequence mixer or a layer type no registered family covers."""
    for name, module in model.named_modules():
        if type(module).__name__ in MIXER_FAMILIES:
            continue
        for child_name, child in module.named_children():
            depthwise = isinstance(child, torch.nn.Conv1d) and child.groups == child.in_channels > 1
            if depthwise and child.kernel_size[0] > 1:
                raise ValueError(
                    f"{type(model).__name__}: {name or 'the model'} ({type(module).__name__}) runs a depthwise "
                    f"convolution ({child_name}) along the sequence and is not a registered hybrid layer, so "
                    "thdpack cannot keep packed samples apart in it; see docs/hybrid.md to register its family")
    unknown = sorted(t for t in layer_types if t not in ATTENTION_LAYER_TYPES)
    if unknown and not mixers:
        raise ValueError(
            f"{type(model).__name__}: its config lists layer types {unknown}, which are not attention and which no "
            "registered hybrid family describes; thdpack refuses rather than guess (docs/hybrid.md)")
