"""``check_dataset``: :func:`~thdpack.check.compare.check_packing` over a seeded sample of a dataset's packs, one
pack at a time, in one report (what ``thdpack check`` runs).

The packs come from :func:`thdpack.check.pack_sources.read_packs` (a packed build as built, a build config or
a JSON Lines file of token ids planned as ``thdpack build`` plans them); a built pack is run as its own loader
collates it, a planned one as ``build_thd_batch`` builds it with the layout it was planned with, each through
the call the README gives, and checked by :func:`~thdpack.check.compare.check_pack`.
"""

from __future__ import annotations

import contextlib

import numpy as np

from thdpack.check.compare import check_pack
from thdpack.check.pack_sources import Pack, Packs, read_packs
from thdpack.check.report import TOLERANCES, CheckReport


def check_dataset(model, data, *, packs: int = 3, seed: int = 0, pack_size: int | None = None, grad: bool = False,
                  flops: bool = True, tolerance: float | None = None, progress: bool = False) -> CheckReport:
    """Check ``packs`` packs of ``data`` on ``model``, as :func:`thdpack.check_packing` checks one.

    Args:
        model: a transformers causal LM (or Qwen-VL model), in the dtype and on the device to check.
        data: a packed build directory, a build config (a ``BuildConfig`` or its YAML file), or a JSON Lines
            file of ``input_ids`` (and ``labels`` or ``loss_mask``) with ``pack_size``
            (:func:`~thdpack.check.pack_sources.read_packs`).
        packs, seed: how many packs, and the seed of the draw that picks them.
        grad, flops, tolerance: as :func:`thdpack.check_packing` takes them.
        progress: a progress bar per pack on stderr (one step per forward).

    Returns:
        a :class:`CheckReport` of the packs, in pack order. ``ValueError`` (before any pack runs) when a
        token id of a picked pack is out of the model's vocabulary, naming the pack, sample and token.
    """
    chosen = read_packs(data, count=packs, seed=seed, pack_size=pack_size, progress=progress)
    return check_packs(model, chosen, grad=grad, flops=flops, tolerance=tolerance, progress=progress)


def check_packs(model, chosen: Packs, *, grad: bool = False, flops: bool = True, tolerance: float | None = None,
                progress: bool = False, on_pack=None) -> CheckReport:
    """Check the packs :func:`read_packs` picked (``on_pack(pack_check)`` after each), in one report."""
    first = next(model.parameters())
    dtype = str(first.dtype).removeprefix("torch.")
    attention = getattr(model.config, "_attn_implementation", None)
    report = CheckReport(type(model).__name__, dtype, str(first.device), attention or "default",
                         TOLERANCES[dtype] if tolerance is None else float(tolerance))
    for pack in chosen.packs:
        check_vocabulary(model, pack, chosen.layout.get("pad_token_id", 0))
    for pack in chosen.packs:
        with _forward_bar(model, pack, flops, progress):
            result = check_pack(model, pack.samples, grad=grad, flops=flops, attn_implementation=attention,
                                tolerance=report.tolerance, pack=pack.index, **_packed_call(model, pack, chosen,
                                                                                            attention))
        report.packs.append(result)
        if on_pack is not None:
            on_pack(result)
    return report


def _packed_call(model, pack: Pack, chosen: Packs, attention) -> dict:
    """The keywords of ``check_pack`` that say how the pack is run: a built pack's batch (its loader's) as the
    README runs it (``packed_model(model)(**to_hf_kwargs(batch))``) with each sample's span in it; a planned
    pack's layout keywords (``check_pack`` builds and runs it the same way)."""
    if pack.batch is None:
        return dict(batch=None, spans=None, vlm=None, **chosen.layout)
    from thdpack.integrations import packed_model, to_hf_kwargs

    packed_model(model)
    starts = pack.batch.cu_seqlens_padded[:-1].tolist()
    spans = [(a, a + len(s["input_ids"])) for a, s in zip(starts, pack.samples)]
    return dict(batch=to_hf_kwargs(pack.batch, attn_implementation=attention), spans=spans, vlm=None)


def check_vocabulary(model, pack: Pack, pad_token_id: int = 0) -> None:
    """``ValueError`` naming the first token id of ``pack`` (or the pad id) the model has no embedding for."""
    vocab = int(model.get_input_embeddings().num_embeddings)
    for i, (sample, where) in enumerate(zip(pack.samples, pack.where)):
        ids = np.asarray(sample["input_ids"]).reshape(-1)
        if ids.size and int(ids.max()) >= vocab:
            p = int(np.argmax(ids >= vocab))
            raise ValueError(f"pack {pack.index}, sample {i} ({where}): token id {int(ids[p])} at position {p} is "
                             f"outside the model's vocabulary ({vocab} embeddings): is this the model the data "
                             "was tokenized for?")
    if pad_token_id >= vocab:
        raise ValueError(f"the data's pad token id {pad_token_id} is outside the model's vocabulary ({vocab} "
                         "embeddings): is this the model the data was tokenized for?")


@contextlib.contextmanager
def _forward_bar(model, pack: Pack, flops: bool, progress: bool):
    """A tqdm bar on stderr while ``pack`` runs, one step per forward of the model (the packed run, each
    sample alone, the FLOPs count); nothing when ``progress`` is off."""
    if not progress:
        yield
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=len(pack.samples) + 1 + int(flops), desc=f"pack {pack.index}", unit="forward", leave=False)
    def step(*args) -> None:  # a forward hook that returns something replaces the model's output
        bar.update(1)

    handle = model.register_forward_hook(step)
    try:
        yield
    finally:
        handle.remove()
        bar.close()
