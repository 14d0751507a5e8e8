"""What a packed call lacks to keep its samples apart, read off the call itself: the boundary inputs the
model's layers read, positions that restart at each sample, labels that stay inside each sample. The check
reports it beside the first module that differs (``check_packing(batch=...)`` judges other collators'
batches this way); each line names the fix (docs/check.md, "Other collators' batches").

What transformers 5.25 does with a packed row, as these lines state it: sdpa / eager / flex find the samples
from restarting ``position_ids`` only when the call has no ``attention_mask`` and no cache (so under a
config's default ``use_cache=True`` they mask the row as one sequence, and never read ``cu_seq_lens_q``);
its flash paths derive ``cu_seq_lens_q`` from restarting ``position_ids``, ``thdpack_varlen`` does not;
hybrid layers read ``seq_idx`` (convolutions, Mamba-2 scans) and ``cu_seq_lens_q`` (Gated DeltaNet scans)
and keep the samples apart only in their CUDA kernels (elsewhere transformers refuses the boundaries). A
model prepared by ``thdpack.integrations.packed_model`` gets its mask and per-sample hybrid layers from thdpack.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import torch

from thdpack.attention.backends import attention_kind
from thdpack.check.probes import Probes
from thdpack.common.samples import IGNORE_INDEX
from thdpack.integrations.hybrid.mixers import MIXER_FAMILIES
from thdpack.integrations.hybrid.packed_model import _native, text_row

FLATTENING = "DataCollatorWithFlattening"
PREPARE = "or prepare the model with thdpack.integrations.packed_model(model)"


def boundary_problems(kwargs: Mapping, spans, model=None) -> list[str]:
    """What a packed call lacks to keep its samples apart, in words, each with its fix: a boundary input
    absent that the model's layers read (``seq_idx`` / ``cu_seq_lens_q`` for hybrid layers, ``cu_seq_lens_q``
    for ``thdpack_varlen``, a mask where the call has a cache or a padding mask), hybrid boundaries without
    the kernels that read them, ``position_ids`` absent or not restarting at each sample, labels scored
    across a boundary. ``spans``: each sample's ``(start, end)`` in the row; one sample lacks nothing."""
    if len(spans) < 2:
        return []
    prepared = bool(getattr(model, "_thdpack_packed_model", False))
    kinds = {kind for _, kind, _ in Probes(model).targets} if model is not None else set()
    out = _hybrid_problems(kwargs, model, prepared)
    if "attention" in kinds:
        out += _attention_problems(kwargs, model, prepared)
    return out + _position_problems(kwargs, spans) + _label_problems(kwargs, spans)


def _hybrid_problems(kwargs: Mapping, model, prepared: bool) -> list[str]:
    """The hybrid layers' boundaries: ``seq_idx`` (convolutions, Mamba-2 scans), ``cu_seq_lens_q`` (Gated
    DeltaNet scans), and the kernels transformers needs to read them (``packed_model`` needs either one)."""
    families = {MIXER_FAMILIES[type(m).__name__] for m in (model.modules() if model is not None else ())
                if type(m).__name__ in MIXER_FAMILIES}
    if not families:
        return []
    kinds = {f.kind for f in families}
    seq_idx, cu = kwargs.get("seq_idx") is not None, kwargs.get("cu_seq_lens_q") is not None
    device = next(model.parameters()).device
    native = all(_native(f, device) for f in families)  # transformers' kernels run the layers, packed_model or not
    out = []
    if prepared and not native and (seq_idx or cu):
        return out  # packed_model runs each hybrid layer on each sample's span
    if not seq_idx and kinds & {"gdn", "mamba2", "shortconv"}:
        out.append(f"has no seq_idx: the short convolution{'s and Mamba-2 scans' if 'mamba2' in kinds else 's'} of "
                   f"its hybrid layers run across the samples (pass seq_idx: {FLATTENING}(return_seq_idx=True))")
    if not cu and "gdn" in kinds:
        out.append(f"has no cu_seq_lens_q: its Gated DeltaNet scans run over the whole row (pass it: "
                   f"{FLATTENING}(return_flash_attn_kwargs=True))")
    if "mamba1" in kinds and not prepared:
        out.append(f"runs Mamba-1 layers, which transformers hands no boundary at all: {PREPARE.removeprefix('or ')}")
    read = seq_idx or (cu and "gdn" in kinds)  # Mamba-2 and short convolutions read seq_idx only
    missing = _missing_kernels(families, device) if read and not native and not prepared else []
    if missing:
        out.append(f"carries hybrid boundaries, which transformers keeps apart only in CUDA kernels "
                   f"({', '.join(missing)}), absent or not on this device, so it refuses them: run on CUDA with "
                   f"those installed, {PREPARE} (each hybrid layer run per sample)")
    return out


def _missing_kernels(families, device: torch.device) -> list[str]:
    """The kernel packages transformers lacks here for ``families``' layers (all of them off CUDA)."""
    needed = sorted({k for f in families for k in (f.kernels or ())})
    if device.type != "cuda":
        return needed
    return [k for k in needed if importlib.util.find_spec(k) is None]


def _attention_problems(kwargs: Mapping, model, prepared: bool) -> list[str]:
    """The attention layers' boundaries: a mask (sdpa / eager / flex) or ``cu_seq_lens_q`` (varlen)."""
    config = getattr(model, "config", None)
    attention = str(getattr(config, "_attn_implementation", "") or "")
    try:
        kind = attention_kind(attention) if attention else None
    except ValueError:
        return []
    if kind is None:
        return []
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and kind in ("dense", "flex"):
        return [f"has a [batch, tokens] attention_mask (a padding mask), with which transformers gives {attention} "
                "one causal mask over the whole row, whatever position_ids say: drop it (a packed row has none)"]
    if prepared or mask is not None:
        return []
    use_cache = kwargs.get("use_cache")
    cache = (getattr(config, "use_cache", False) if use_cache is None else use_cache) \
        or kwargs.get("past_key_values") is not None
    if kind in ("dense", "flex") and cache:
        unread = f"; {attention} never reads cu_seq_lens_q" if kwargs.get("cu_seq_lens_q") is not None else ""
        return [f"has no attention mask and use_cache is on (the config's default): transformers then gives "
                f"{attention} one causal mask over the whole row (it finds the samples from position_ids only "
                f"without a cache){unread}: pass use_cache=False, {PREPARE}"]
    if kind == "flash" and kwargs.get("cu_seq_lens_q") is None and "flash" not in attention and "/" not in attention:
        return [f"has no cu_seq_lens_q: {attention} reads the samples from cu_seq_lens_q only (not from position_ids) "
                f"and attends over the whole row: pass it ({FLATTENING}(return_flash_attn_kwargs=True)), {PREPARE}"]
    return []


def _position_problems(kwargs: Mapping, spans) -> list[str]:
    """``position_ids`` absent, or not counting 0, 1, ... over each sample (RoPE; the mask found from them)."""
    positions = kwargs.get("position_ids")
    if positions is None:
        return ["has no position_ids: RoPE positions run on across the samples, and transformers cannot find the "
                f"samples from them (pass them: {FLATTENING}(return_position_ids=True), its default)"]
    row = text_row(torch.as_tensor(positions).cpu())  # [1, T], or a VLM's [4, 1, T]: its text row
    if row is None:
        return []
    row = row.long()
    bad = [i for i, (a, b) in enumerate(spans) if not torch.equal(row[a:b], torch.arange(b - a))]
    if bad:
        return [f"has position_ids that do not count 0, 1, ... over sample(s) {bad[:5]} (they restart at 0 at each "
                "sample's first token)"]
    return []


def _label_problems(kwargs: Mapping, spans) -> list[str]:
    """Labels whose shift (transformers scores token t against label t+1) crosses a sample boundary."""
    labels = kwargs.get("labels")
    if labels is None:
        return []
    row = torch.as_tensor(labels).reshape(-1).cpu()
    crossing = [i for i, (a, _) in enumerate(spans) if i and a < row.numel() and int(row[a]) != IGNORE_INDEX]
    if not crossing:
        return []
    values = sorted({int(row[spans[i][0]]) for i in crossing})
    return [f"scores labels across a boundary: the label at the first token of sample(s) {crossing[:5]} is "
            f"{values[:3]}, not -100, so the previous sample's last token is scored against it (set -100 there: "
            f"{FLATTENING}(separator_id=-100), its default)"]
