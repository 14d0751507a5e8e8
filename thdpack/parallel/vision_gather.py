"""The tensors of a vision split (:func:`thdpack.planning.vision_split.plan_vision_split`): what a CP
rank feeds its vision tower, the all-gather of the ranks' embeddings back into the pack's sequence,
and the rows a CP shard of the text stream takes from it.

::

    rank r:  vision_rank_inputs ─▶ tower ─▶ local [n_r, D] ──┐  all_gather, blocks padded to max n_r
                                                             ├─▶ [Σ n_r, D] on every rank: images, then videos
    rank q:  ...                                  [n_q, D] ──┘  (backward: reduce-scatter, summed)
             shard_vision_rows(embeds, shard, split) ─▶ the rows of the shard's own vision tokens, local order

The plan is read by its attributes (``cp_size``, ``rank_tokens``, ``local_tokens``, ``num_image_tokens``,
``rank_pixel_rows``, ``rank_grid_thw``, ``item_grids``); this module knows no planning code. Inputs that are
not the plan's (a plan of another pack, a text batch, a batch without its pixels, embeddings of another
length) are refused with one ``TypeError`` / ``ValueError`` naming the argument and both counts: the
grids the plan was made from (``item_grids``) are compared with the batch's, when it holds them, and the
pixel rows and embedding rows with the plan's.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from thdpack.common.align import check_int
from thdpack.parallel.cp import vision_shard_extras
from thdpack.parallel.groups import check_process_group

_KINDS = (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw"))


def vision_rank_inputs(batch, plan, rank: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What CP rank ``rank`` feeds the vision tower: ``(pixel_values, grid_thw)``.

    Args:
        batch: the VLM batch the plan was made for (a :class:`thdpack.ThdBatch`, one of its CP shards,
            or its ``extras``): ``pixel_values`` / ``pixel_values_videos`` of the whole pack.
        plan: its :class:`~thdpack.planning.vision_split.VisionSplit`.
        rank: this rank's index in the CP group.

    Returns:
        ``pixel_values`` ``[rows, D]``: the rank's image rows, then its video rows (a view of the
        batch's tensor when the rank's units are of one kind), and ``grid_thw`` int64 ``[k, 3]`` on the
        same device; an empty rank with a placeholder gets ``m × m`` zero rows and ``[[1, m, m]]``.
        None when the pack has no image or video (no rank runs the tower).

    ``TypeError`` / ``ValueError`` naming the argument for a batch that is not the plan's (its grids or its
    pixel rows of either kind differ from the plan's: both counts given) or an object that is not a batch.
    """
    _check_plan(plan)
    check_int(rank, "rank", 0, below=plan.cp_size, hint=" (this rank's index in the CP group)")
    extras = _extras_of(batch, "batch")
    _check_grids(extras, plan, "batch")
    _check_pixels(extras, plan)
    if not plan.num_units:
        return None
    images, videos = extras.get("pixel_values"), extras.get("pixel_values_videos")
    like = images if images is not None else videos
    grid = torch.from_numpy(plan.rank_grid_thw(rank)).to(like.device)
    (a, b), (c, d) = plan.rank_pixel_rows(rank)
    parts = [t[lo:hi] for t, lo, hi in ((images, a, b), (videos, c, d)) if t is not None and hi > lo]
    if not parts:
        rows = int(grid.prod(-1).sum())  # the placeholder frame (or nothing)
        return like.new_zeros(rows, like.shape[-1]), grid
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), grid


def gather_vision_embeddings(local, plan, group=None):
    """All ranks' vision embeddings in the pack's order, from this rank's tower output.

    A collective: call it on every rank of the CP group with the tower's output for
    :func:`vision_rank_inputs`. The uneven blocks are padded to the largest (gloo's all-gather takes
    equal sizes), gathered once, and cut back; several tensors of the same rows (the merged embeddings and
    Qwen3-VL's deepstack features) travel in one collective, side by side.

    Args:
        local: ``[plan.local_tokens[rank], D]`` (the placeholder's row included), or a list / tuple of
            such tensors (widths may differ, dtype and device the same).
        plan: the :class:`~thdpack.planning.vision_split.VisionSplit` every rank holds.
        group: the CP process group (None: the default group); its size must be ``plan.cp_size``.
            With ``cp_size == 1`` nothing is sent and ``torch.distributed`` need not be set up.

    Returns:
        ``[plan.num_tokens, D]`` (a list for a list): image embeddings (``plan.num_image_tokens`` rows)
        then video embeddings, each in the order the unsplit tower gives them.

    Differentiable: every rank holds the whole sequence and may use any row, so backward sums each
    row's gradient over the ranks (a reduce-scatter) and hands every rank those of its own rows (zero
    for a placeholder). When any rank's ``local`` needs a gradient, every rank takes part in the
    backward collective (a rank whose ``local`` does not, an empty one, joins with a stand-in), so
    ranks never wait on each other; a wrong row count on any rank raises on every rank.
    """
    _check_plan(plan)
    check_process_group(group, "group")
    parts = [local] if isinstance(local, torch.Tensor) else list(local) if isinstance(local, (list, tuple)) else []
    if not parts or not all(isinstance(p, torch.Tensor) and p.dim() == 2 for p in parts):
        raise TypeError("local must be a 2-D tensor [rows, D] or a list of them (the tower's outputs)")
    rows = {int(p.shape[0]) for p in parts}
    if len(rows) != 1:
        raise ValueError(f"the tensors of local have different row counts {sorted(rows)}; they must be the "
                         "same tokens (the merged embeddings and their deepstack features)")
    widths = [int(p.shape[1]) for p in parts]
    joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    full = _gather(joined, plan, group)
    if isinstance(local, torch.Tensor):
        return full
    return list(torch.split(full, widths, dim=1))


def shard_vision_rows(embeds, shard, plan):
    """The rows of ``embeds`` (:func:`gather_vision_embeddings`'s output, or a list of them) for the vision
    tokens of ``shard``, in the shard's token order: ``inputs_embeds[mm_token_type_ids != 0] = rows``.

    ``shard``: a CP shard of the pack (``thdpack.shard(batch, cp_size=, cp_rank=)``: its ``image_embed_index`` /
    ``video_embed_index``) or the whole batch; ``plan`` gives where the video rows start. ``TypeError`` /
    ``ValueError`` naming the argument for embeddings of another row count than the plan's tokens, a text
    batch (no ``mm_token_type_ids``), or a shard of another pack than the plan's (both counts given).
    """
    _check_plan(plan)
    types = _token_types(shard)
    _check_grids(shard.extras, plan, "shard")
    parts = _embedding_rows(embeds, plan)
    extras = shard.extras
    whole = "image_embed_index" not in extras
    if whole:  # the whole stream
        extras = vision_shard_extras(types, torch.arange(types.shape[0], device=types.device))
    images, videos = extras["image_embed_index"], extras["video_embed_index"]
    _check_token_rows(images, videos, plan, whole)
    kind = types[types != 0]
    index = torch.empty(kind.shape[0], dtype=torch.int64, device=kind.device)
    index[kind == 1] = images.to(kind.device)
    index[kind == 2] = videos.to(kind.device) + plan.num_image_tokens
    rows = [e[index.to(e.device)] for e in parts]
    return rows[0] if isinstance(embeds, torch.Tensor) else rows


# --------------------------------------------------------------------------- the inputs belong to the plan


def _check_plan(plan) -> None:
    if not all(hasattr(plan, name) for name in ("cp_size", "rank_pixel_rows", "rank_grid_thw", "item_grids")):
        raise TypeError("plan must be a VisionSplit (thdpack.vlm.plan_vision_split(batch, cp_size, model_config)), "
                        f"got {type(plan).__name__}")


def _extras_of(batch, name: str) -> Mapping:
    extras = batch if isinstance(batch, Mapping) else getattr(batch, "extras", None)
    if not isinstance(extras, Mapping):
        raise TypeError(f"{name} must be a VLM ThdBatch, one of its CP shards or its extras (a mapping), got "
                        f"{type(batch).__name__}")
    return extras


def _check_grids(extras: Mapping, plan, name: str) -> None:
    """``ValueError`` when ``extras`` holds an ``image_grid_thw`` / ``video_grid_thw`` that is not the plan's."""
    for (kind, _, key), want in zip(_KINDS, plan.item_grids()):
        if key not in extras:
            continue
        value = extras[key]
        got = np.zeros((0, 3), np.int64) if value is None else np.asarray(
            value.tolist() if hasattr(value, "tolist") else value, dtype=np.int64).reshape(-1, 3)
        if not np.array_equal(got, want):
            raise ValueError(f"{name}'s {key} has {got.shape[0]} {kind}(s) {got.tolist()[:4]} but the plan "
                             f"{want.shape[0]} {want.tolist()[:4]}: a plan of another pack (plan_vision_split on "
                             f"this {name}'s pack)")


def _check_pixels(extras: Mapping, plan) -> None:
    """``TypeError`` / ``ValueError`` unless the batch's pixel rows of each kind are the plan's (``[rows, D]``)."""
    for (kind, key, _), grid in zip(_KINDS, plan.item_grids()):
        pixels, want = extras.get(key), int(grid.prod(1).sum())
        if pixels is not None and not (isinstance(pixels, torch.Tensor) and pixels.dim() == 2):
            raise TypeError(f"batch's {key} must be a 2-D tensor [rows, D], got {type(pixels).__name__}"
                            f"{list(getattr(pixels, 'shape', []))}")
        rows = 0 if pixels is None else int(pixels.shape[0])
        if rows != want:
            raise ValueError(f"batch's {key} has {rows} rows but the plan encodes {want} {kind} pixel rows: "
                             "a plan of another pack, or a batch without its pixels")


def _token_types(shard) -> torch.Tensor:
    token_extras = getattr(shard, "token_extras", None)
    if not isinstance(token_extras, Mapping) or not isinstance(getattr(shard, "extras", None), Mapping):
        raise TypeError("shard must be a VLM ThdBatch (the pack, or its CP shard: thdpack.shard(batch, cp_size=, "
                        f"cp_rank=)), got {type(shard).__name__}")
    types = token_extras.get("mm_token_type_ids")
    if types is None:
        raise ValueError("shard has no mm_token_type_ids: a text batch; shard_vision_rows takes a VLM batch "
                         "(built with the model_config) or its CP shard")
    return types


def _embedding_rows(embeds, plan) -> list[torch.Tensor]:
    """``embeds`` as a list of 2-D tensors of ``plan.num_tokens`` rows, else ``TypeError`` / ``ValueError``."""
    parts = [embeds] if isinstance(embeds, torch.Tensor) else list(embeds) if isinstance(embeds, (list, tuple)) else []
    if not parts or not all(isinstance(e, torch.Tensor) and e.dim() == 2 for e in parts):
        raise TypeError("embeds must be a 2-D tensor [num_tokens, D] or a list of them "
                        f"(gather_vision_embeddings' output), got {type(embeds).__name__}")
    for e in parts:
        if e.shape[0] != plan.num_tokens:
            raise ValueError(f"embeds has {int(e.shape[0])} rows but the plan gathers {plan.num_tokens} (its vision "
                             "tokens: gather_vision_embeddings' output for this pack)")
    return parts


def _check_token_rows(images: torch.Tensor, videos: torch.Tensor, plan, whole: bool) -> None:
    """``ValueError`` when the shard's vision tokens are not the plan's: the whole stream must hold the plan's
    image and video tokens, a CP shard only rows among them."""
    for kind, index, total in (("image", images, plan.num_image_tokens),
                               ("video", videos, plan.num_tokens - plan.num_image_tokens)):
        count = int(index.shape[0])
        last = int(index.max()) + 1 if count else 0
        if (count != total) if whole else (last > total):
            got = f"holds {count} {kind} tokens" if whole else f"reads {kind} embedding rows up to {last}"
            raise ValueError(f"shard {got} but the plan has {total} {kind} tokens: a plan of another pack")


# --------------------------------------------------------------------------- the collective


def _group_rank(plan, group) -> int:
    if plan.cp_size == 1:
        return 0
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"the plan is for cp_size={plan.cp_size}: initialise torch.distributed and pass the "
                           "CP process group")
    size = dist.get_world_size(group)
    if size != plan.cp_size:
        raise ValueError(f"the process group has {size} ranks but the plan is for cp_size={plan.cp_size}")
    return dist.get_rank(group)


def _gather(local: torch.Tensor, plan, group) -> torch.Tensor:
    """The padded all-gather (two flag rows after the blocks: needs a gradient, wrong row count), then the
    blocks cut back by :class:`_GatheredRows` (differentiable) or plainly (no rank needs a gradient)."""
    rank = _group_rank(plan, group)
    counts = [int(c) for c in plan.rank_tokens]
    local_rows = [int(c) for c in plan.local_tokens]
    wants_grad = torch.is_grad_enabled() and local.requires_grad
    wrong = int(local.shape[0]) != local_rows[rank]
    if plan.cp_size == 1:
        if wrong:
            raise ValueError(_wrong_rows_message(local, local_rows, rank))
        return local[: counts[0]]
    import torch.distributed as dist

    most = max(local_rows)
    with torch.no_grad():
        send = local.new_zeros(most + 2, local.shape[1])
        if not wrong:
            send[: local.shape[0]] = local
        send[most, 0] = float(wants_grad)
        send[most + 1, 0] = float(wrong)
        blocks = local.new_empty(plan.cp_size, most + 2, local.shape[1])
        dist.all_gather(list(blocks.unbind(0)), send, group=group)
    flags = blocks[:, most:, 0].cpu()  # one device sync: [cp, (needs a gradient, wrong row count)]
    if bool(flags[:, 1].any()):
        bad = flags[:, 1].nonzero().flatten().tolist()
        raise ValueError(_wrong_rows_message(local, local_rows, rank) if wrong else
                         f"gather_vision_embeddings: rank(s) {bad} gave a tower output of the wrong row count "
                         "(their error says more); every rank stops here")
    if not bool(flags[:, 0].any()):
        return _cut(blocks, counts)
    source = local if wants_grad else torch.zeros((), device=local.device, requires_grad=True)
    return _GatheredRows.apply(source, blocks, counts, local_rows[rank], group)


def _wrong_rows_message(local, local_rows, rank) -> str:
    return (f"gather_vision_embeddings: rank {rank}'s tower output has {int(local.shape[0])} rows but the plan "
            f"gives it {local_rows[rank]} (per rank: {local_rows}); run the tower on vision_rank_inputs(batch, "
            "plan, rank)")


def _cut(blocks: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([blocks[r, :c] for r, c in enumerate(counts)])


class _GatheredRows(torch.autograd.Function):
    """Forward: the gathered blocks cut back to their rows. Backward: each rank's rows of the summed
    gradient (a reduce-scatter over the padded blocks); the stand-in of a rank without a gradient of its
    own gets none, but the rank still takes part."""

    @staticmethod
    def forward(ctx, source, blocks, counts, rows, group):
        ctx.counts, ctx.rows, ctx.group, ctx.most = counts, rows, group, blocks.shape[1] - 2
        ctx.stand_in = source.dim() == 0
        return _cut(blocks, counts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        counts, most = ctx.counts, ctx.most
        padded = grad.new_zeros(len(counts), most, grad.shape[1])
        start = 0
        for r, c in enumerate(counts):
            padded[r, :c] = grad[start:start + c]
            start += c
        mine = grad.new_empty(most, grad.shape[1])
        dist.reduce_scatter(mine, list(padded.unbind(0)), group=ctx.group)
        return (None if ctx.stand_in else mine[: ctx.rows]), None, None, None, None

