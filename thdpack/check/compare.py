"""``check_packing``: run a model on a pack and on each of its samples alone, and compare them layer by layer.

The packed call is the one thdpack's README gives (``packed_model(model)(**to_hf_kwargs(batch))``), or the
keyword arguments another collator made for the same samples (``batch=``: the model is run as given). The
reference never uses thdpack: each sample alone through the model (batch axis 1, the model's own positions).
Every decoder layer, sequence mixer and mixer step is compared on each sample's tokens
(:mod:`thdpack.check.probes`), then the logits, the loss (token mean and sample mean) and, with ``grad``,
every parameter's gradient. One pack at a time; hooks keep only the outputs they compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from thdpack.check.diagnose import boundary_problems
from thdpack.check.probes import Probes, Watched
from thdpack.check.report import TOLERANCES, CheckReport, ModuleDiff, PackCheck, SampleCheck, ValueCheck
from thdpack.check.step_flops import step_flops
from thdpack.common.samples import IGNORE_INDEX

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def check_packing(model, samples: Sequence[Mapping], *, batch: Mapping | None = None, spans=None, grad: bool = False,
                  flops: bool = True, attn_implementation: str | None = None, vlm=None, tolerance: float | None = None,
                  pack: int = 0, **layout) -> CheckReport:
    """Check that ``model`` gives on the pack of ``samples`` what it gives on each sample alone.

    Args:
        model: a transformers causal LM (or Qwen-VL model), in the dtype and on the device to check.
        samples: the pack's samples, each a mapping of ``input_ids`` and ``labels`` or ``loss_mask`` (and a VLM
            sample's ``pixel_values`` / ``image_grid_thw`` / ... as the family's processor gives them).
        batch: another collator's keyword arguments for the same samples, end to end (judged as given; the model
            is not prepared); None: thdpack's batch (``build_thd_batch(samples, **layout)``) through
            ``packed_model``, which prepares ``model`` in place as the README does. ``spans``: where each sample's tokens lie in ``batch`` (``(start, end)`` each);
            default: the samples one after another.
        grad: compare every parameter's gradient of the token-mean loss too.
        flops: count the packed forward's FLOPs (thdpack, torch's ``FlopCounterMode``, a pack-length count).
        attn_implementation, vlm, layout: what ``to_hf_kwargs`` / ``build_thd_batch`` take.
        tolerance: max ``|packed - alone| / max |alone|`` per tensor (default by dtype: :data:`TOLERANCES`).

    Returns:
        a :class:`~thdpack.check.report.CheckReport` of one pack (``.ok``, ``.table()``, ``.to_dict()``).
    """
    dtype = next(model.parameters()).dtype
    tol = TOLERANCES[str(dtype).removeprefix("torch.")] if tolerance is None else float(tolerance)
    attention = attn_implementation or getattr(model.config, "_attn_implementation", None) or "default"
    report = CheckReport(type(model).__name__, str(dtype).removeprefix("torch."), str(next(model.parameters()).device),
                         attention, tol)
    report.packs.append(check_pack(model, samples, batch=batch, spans=spans, grad=grad, flops=flops,
                                   attn_implementation=attn_implementation, vlm=vlm, tolerance=tol, pack=pack,
                                   **layout))
    return report


def check_pack(model, samples, *, batch, spans, grad, flops, attn_implementation, vlm, tolerance, pack,
               **layout) -> PackCheck:
    """One pack's :class:`PackCheck` (:func:`check_packing` without the report around it)."""
    device = next(model.parameters()).device
    kwargs, spans = _packed_call(model, samples, batch, spans, attn_implementation, vlm, layout)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    result = PackCheck(pack, problems=boundary_problems(kwargs, spans, model))
    probes = Probes(model)
    params = [p for p in model.parameters() if p.requires_grad] if grad else []
    try:
        with probes.watch(), torch.set_grad_enabled(grad):
            out = model(**kwargs)
    except Exception as exc:  # the model's own refusal (transformers, packed_model): the report says it
        result.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        return result
    packed = {name: probes.stream(name) for name in probes.outputs}
    watched = dict(probes.watched)
    logits = out.logits[0].detach().float()
    packed_loss = None if getattr(out, "loss", None) is None else float(out.loss.detach())
    packed_grads = _grads(out.loss, params) if grad and packed_loss is not None else None
    del out
    sums, counts, alone_grads = [], [], None
    for i, sample in enumerate(samples):
        check, compared, token_sum, count, grads = _alone(model, probes, i, sample, spans[i], packed, watched,
                                                          logits, tolerance, params, device)
        result.samples.append(check)
        result.compared.update(compared)
        sums.append(token_sum)
        counts.append(count)
        alone_grads = grads if alone_grads is None else [a.add_(g) for a, g in zip(alone_grads, grads)]
    result.compared = {n: result.compared[n] for n in sorted(result.compared, key=lambda n: watched[n].order)}
    result.skipped = [n for n in sorted(watched, key=lambda n: watched[n].order) if n not in result.compared]
    result.values = _loss_checks(kwargs, logits, spans, sums, counts, tolerance, packed_loss)
    if packed_grads is not None and alone_grads is not None:
        total = max(sum(counts), 1)
        result.values.append(_grad_check(model, params, packed_grads, [g / total for g in alone_grads], tolerance))
    if flops:
        result.flops = step_flops(model, kwargs, spans, int(logits.shape[0]))
    return result


def _packed_call(model, samples, batch, spans, attn_implementation, vlm, layout):
    """The packed call's keyword arguments and each sample's ``(start, end)`` span in its stream."""
    lengths = [len(_ids(s)) for s in samples]
    if batch is not None:
        if layout or vlm is not None:
            raise TypeError("check_packing(batch=...) judges the batch as given: pass no layout keywords or vlm")
        rows = torch.as_tensor(batch["input_ids"]).reshape(-1, torch.as_tensor(batch["input_ids"]).shape[-1])
        if rows.shape[0] != 1:
            raise ValueError(f"check_packing(batch=...) judges a packed batch, one row of samples end to end "
                             f"(input_ids [1, T]); got input_ids {tuple(rows.shape)}: a padded batch keeps its "
                             "samples apart by rows, so there is no packing to check (check one row of it)")
        if spans is None:
            ends = np.cumsum([0] + lengths)
            spans = list(zip(ends[:-1].tolist(), ends[1:].tolist()))
        spans = [tuple(int(v) for v in span) for span in spans]
        if len(spans) != len(samples) or (spans and spans[-1][1] > rows.shape[1]):
            raise ValueError(f"check_packing(batch=...): {len(spans)} span(s) ending at {spans[-1][1] if spans else 0} "
                             f"for {len(samples)} sample(s) in a row of {rows.shape[1]} tokens; pass spans= where "
                             "each sample lies in the batch")
        return dict(batch), spans
    from thdpack.batching.builder import build_thd_batch
    from thdpack.integrations import packed_model, to_hf_kwargs

    built = build_thd_batch(list(samples), vlm=vlm, **layout)
    packed_model(model)
    starts = built.cu_seqlens_padded[:-1].tolist()
    return to_hf_kwargs(built, attn_implementation=attn_implementation), [(a, a + n) for a, n in zip(starts, lengths)]


def _alone(model, probes: Probes, i: int, sample, span, packed: dict, watched: dict[str, Watched], logits,
           tolerance: float, params, device):
    """Sample ``i`` run alone: its :class:`SampleCheck`, the outputs compared (``{name: kind}``), the sum and
    count of its token losses, and (with ``params``) the gradients of the summed loss."""
    with probes.watch(), torch.set_grad_enabled(bool(params)):
        out = model(**_alone_inputs(model, sample, device))
    a, b = span
    diffs = _module_diffs(probes, span, packed, watched, tolerance)
    diffs.append(_diff("logits", "logits", "everything before it", logits[a:b], out.logits[0].detach().float(),
                       tolerance, len(watched)))
    first = next((d for d in diffs if not d.ok), None)
    worst = max(diffs, key=lambda d: d.rel)
    labels = torch.as_tensor(_labels(sample), dtype=torch.long, device=device)
    losses = F.cross_entropy(out.logits[0, :-1].float(), labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")
    count = int((labels[1:] != IGNORE_INDEX).sum())
    grads = _grads(losses, params) if params else None
    compared = {d.name: d.kind for d in diffs[:-1]}
    return SampleCheck(i, b - a, len(diffs), first, worst), compared, float(losses.detach()), count, grads


def _alone_inputs(model, sample, device) -> dict:
    """The keyword arguments of ``sample`` alone, as its processor gives them: ``input_ids`` ``[1, s]`` and a VLM
    sample's vision inputs, with ``mm_token_type_ids`` (the sample's own, else 1 at the config's image token
    and 2 at its video token), from which the model computes its own mRoPE."""
    ids = torch.as_tensor(_ids(sample), dtype=torch.long, device=device)[None]
    extra = {k: torch.as_tensor(sample[k]).to(device) for k in VISION_KEYS if k in sample}
    if not extra:
        return {"input_ids": ids}
    dtype = next(model.parameters()).dtype
    extra = {k: v.to(dtype) if v.is_floating_point() and k.startswith("pixel") else v for k, v in extra.items()}
    if sample.get("mm_token_type_ids") is not None:
        types = torch.as_tensor(np.asarray(sample["mm_token_type_ids"]).reshape(1, -1), device=device)
    else:
        config = model.config
        image, video = getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)
        types = (ids == image).int() + 2 * (ids == video).int()
    return dict(extra, input_ids=ids, mm_token_type_ids=types)


def _module_diffs(probes: Probes, span, packed: dict, watched: dict[str, Watched], tolerance: float) -> list:
    """A :class:`ModuleDiff` per watched output, in execution order, on the sample's tokens ``span`` of the
    pack; an output that is not one row per token in both runs is not comparable and left out."""
    a, b = span
    diffs = []
    for name, info in sorted(watched.items(), key=lambda item: item[1].order):
        if name not in probes.outputs:
            continue
        mine, theirs = probes.stream(name), packed[name]
        if theirs.shape[0] < b or mine.shape[0] != b - a or mine.shape[1:] != theirs.shape[1:]:
            continue
        diffs.append(_diff(name, info.kind, info.reads, theirs[a:b], mine, tolerance, info.order))
    return diffs


def _diff(name, kind, reads, packed: torch.Tensor, alone: torch.Tensor, tolerance: float, order: int) -> ModuleDiff:
    delta = float((packed - alone).abs().max()) if alone.numel() else 0.0
    scale = float(alone.abs().max()) if alone.numel() else 0.0
    return ModuleDiff(name, kind, reads, delta, scale, delta / scale if scale > 0 else delta, tolerance, order)


def _loss_checks(kwargs, logits, spans, sums, counts, tolerance, packed_loss) -> list[ValueCheck]:
    """The token-mean loss (the model's own on the packed call when it was given labels, else from the packed
    logits) and the sample-mean loss (from the packed logits and the call's labels), packed vs alone."""
    total = sum(counts)
    alone_token = sum(sums) / total if total else 0.0
    per_sample = [s / c for s, c in zip(sums, counts) if c]
    alone_sample = sum(per_sample) / len(per_sample) if per_sample else 0.0
    out = []
    if packed_loss is not None:
        out.append(_value("loss (token mean)", packed_loss, alone_token, tolerance))
    labels = kwargs.get("labels")
    if labels is not None:
        row = torch.as_tensor(labels).reshape(-1).to(logits.device)
        means = []
        for a, b in spans:
            targets = row[a + 1:b + 1] if b < row.numel() else torch.cat([row[a + 1:b], row.new_full((1,), IGNORE_INDEX)])
            scored = targets != IGNORE_INDEX
            if bool(scored.any()):
                means.append(float(F.cross_entropy(logits[a:b], targets, ignore_index=IGNORE_INDEX)))
        out.append(_value("loss (sample mean)", sum(means) / len(means) if means else 0.0, alone_sample, tolerance))
    return out


def _value(name: str, packed: float, alone: float, tolerance: float) -> ValueCheck:
    return ValueCheck(name, float(packed), float(alone), abs(packed - alone) / max(abs(alone), 1e-12), tolerance)


GRAD_FLOOR = 1e-2  # a parameter's gradient is judged against at least this share of the largest gradient's scale


def _grad_check(model, params, packed, alone, tolerance: float) -> ValueCheck:
    """The worst parameter: ``max |packed - alone|`` over ``max |alone|``, that scale at least
    :data:`GRAD_FLOOR` of the largest parameter's (a gradient that nearly cancels, such as a Gated DeltaNet
    ``A_log``'s, is float rounding relative to its terms, not to its sum)."""
    names = {id(p): n for n, p in model.named_parameters()}
    largest = max((float(g.abs().max()) for g in alone if g.numel()), default=0.0)
    worst = ("", 0.0, 0.0, 0.0)
    for p, gp, ga in zip(params, packed, alone):
        scale = max(float(ga.abs().max()) if ga.numel() else 0.0, GRAD_FLOOR * largest)
        rel = float((gp - ga).abs().max()) / scale if scale > 0 else float(gp.abs().max())
        if rel >= worst[3]:
            worst = (names[id(p)], float(gp.abs().max()), float(ga.abs().max()), rel)
    return ValueCheck("gradients", worst[1], worst[2], worst[3], tolerance, where=worst[0])


def _grads(loss, params) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach().float() for p, g in zip(params, grads)]


def _ids(sample) -> list[int]:
    return [int(v) for v in np.asarray(sample["input_ids"]).reshape(-1)]


def _labels(sample) -> list[int]:
    """A sample's labels in transformers' convention (the loss shifts them): ``labels``, else the ids where
    ``loss_mask`` is set, else every id."""
    ids = np.asarray(sample["input_ids"]).reshape(-1)
    if sample.get("labels") is not None:
        return [int(v) for v in np.asarray(sample["labels"]).reshape(-1)]
    if sample.get("loss_mask") is not None:
        return np.where(np.asarray(sample["loss_mask"]).reshape(-1).astype(bool), ids, IGNORE_INDEX).tolist()
    return ids.tolist()
