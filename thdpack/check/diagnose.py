"""What a packed call lacks to keep its samples apart, read off the call itself: the boundary inputs the
model's layers read, positions that restart at each sample, labels that stay inside each sample. The check
reports it beside the first module that differs (``check_packing(batch=...)`` judges other collators'
batches this way)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from thdpack.check.probes import Probes
from thdpack.common.samples import IGNORE_INDEX


def boundary_problems(kwargs: Mapping, spans, model=None) -> list[str]:
    """What a packed call lacks to keep its samples apart, in words: a boundary input absent that the model's
    layers read (``seq_idx`` for hybrid layers, ``cu_seq_lens_q`` for Gated DeltaNet scans and varlen
    attention, a mask where the call has a cache), ``position_ids`` that do not restart at each sample,
    labels scored across a boundary."""
    out = []
    kinds = {kind for _, kind, _ in Probes(model).targets} if model is not None else set()
    attention = str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")
    if len(spans) > 1:
        if kwargs.get("seq_idx") is None and kinds & {"linear attention", "SSM", "convolution"}:
            out.append("has no seq_idx")
        if kwargs.get("cu_seq_lens_q") is None and ("linear attention" in kinds or "flash" in attention
                                                    or "varlen" in attention):
            out.append("has no cu_seq_lens_q")
        cache = kwargs.get("use_cache", getattr(getattr(model, "config", None), "use_cache", False))
        if (kwargs.get("attention_mask") is None and kwargs.get("cu_seq_lens_q") is None and cache
                and attention in ("sdpa", "eager")):
            out.append(f"has no attention mask nor cu_seq_lens_q, and use_cache is on: transformers then gives "
                       f"{attention} one causal mask over the whole row")
    positions = kwargs.get("position_ids")
    row = _text_positions(positions)
    if positions is None:
        out.append("has no position_ids (positions run on across the samples)")
    elif row is not None:
        bad = [i for i, (a, b) in enumerate(spans) if not torch.equal(row[a:b], torch.arange(b - a))]
        if bad:
            out.append(f"has position_ids that do not count 0, 1, ... over sample(s) {bad[:5]}")
    labels = kwargs.get("labels")
    if labels is not None:
        row = torch.as_tensor(labels).reshape(-1).cpu()
        crossing = [i for i, (a, _) in enumerate(spans) if i and a < row.numel() and int(row[a]) != IGNORE_INDEX]
        if crossing:
            out.append(f"scores labels across a boundary (the first token of sample(s) {crossing[:5]} is the "
                       "previous sample's target)")
    return out


def _text_positions(positions) -> torch.Tensor | None:
    """The text position row of ``position_ids`` (``[1, T]``, or mRoPE's ``[4, 1, T]`` whose first row is
    text), on the CPU; None for 3-row mRoPE (no text row to read)."""
    if positions is None:
        return None
    p = torch.as_tensor(positions).cpu()
    if p.dim() == 2:
        return p[0].long()
    return p[0, 0].long() if p.dim() == 3 and p.shape[0] == 4 else None
