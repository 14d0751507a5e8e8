"""Issue 43 (hardening, third pass): the vision split helpers and hybrid CP under bad input.

* ``vision_rank_inputs`` / ``shard_vision_rows`` / ``gather_vision_embeddings`` refuse inputs that are not the
  plan's (a plan of another pack, embeddings of another row count: silently wrong before) and objects that
  are not batches, shards, plans or embeddings (KeyError / IndexError / AttributeError before), with one
  ``TypeError`` / ``ValueError`` naming the argument and both counts.
* A number of ranks (hybrid CP's ``world_size`` and ``tp_size``, the vision split's ``cp_size``) is bounded
  (:func:`thdpack.parallel.groups.check_ranks`) before any per-rank array (MemoryError, or a hang, before);
  a padding multiple past int64 is named (OverflowError before); a plan that would leave a rank idle is
  refused (returned before, against its documented contract); ``schedule_cost`` checks its schedule.
* A string (any plain data) as a process group is one ``TypeError`` naming the argument.
* Booleans (``sequence_parallel``, ``pack``, ``placeholder``) by :func:`thdpack.common.align.check_bool`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from test_vlm import make_sample, tiny_config  # noqa: E402

import thdpack  # noqa: E402
from thdpack import ThdCollator, build_thd_batch, plan_hybrid_cp, rebalance  # noqa: E402
from thdpack.loaders.hybrid_rebalance import HybridCP, rebalance_hybrid_cp  # noqa: E402
from thdpack.parallel.hybrid_blocks import block_sizes  # noqa: E402
from thdpack.planning.hybrid_cp import HybridCPPlan, schedule_cost  # noqa: E402
from thdpack.vlm import gather_vision_embeddings, plan_vision_split, shard_vision_rows, vision_rank_inputs  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402
from thdpack.integrations import packed_seq_params_dict  # noqa: E402

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, max_examples=40)
FAMILY = "qwen2_vl"
CONFIG = tiny_config(FAMILY)
HUGE = st.one_of(st.integers(2**20, 2**22), st.integers(2**34, 2**62))  # a number of ranks past the bound
NOT_BOOL = st.one_of(st.text(max_size=4), st.integers(), st.none(), st.floats(allow_nan=False), st.just("no"))
PLAIN = st.one_of(st.text(max_size=4), st.integers(), st.floats(allow_nan=False), st.booleans(),
                  st.lists(st.integers(0, 7), max_size=3), st.tuples(st.integers(0, 7)), st.binary(max_size=3))


def _pack(layout, seed: int = 0):
    sample = make_sample(FAMILY, layout, np.random.default_rng(seed))
    return build_thd_batch([sample], vlm=get_family(CONFIG), cp_size=2)


IMAGES = _pack([("text", 3), ("image", (1, 4, 4)), ("text", 2), ("image", (1, 2, 4)), ("text", 1)])  # 4 + 2 tokens
VIDEO = _pack([("text", 3), ("video", (2, 4, 4)), ("text", 2)])  # 8 tokens
TEXT = build_thd_batch([{"input_ids": [1, 2, 3]}], cp_size=2)
IMAGE_PLAN = plan_vision_split(IMAGES, 2, CONFIG)
VIDEO_PLAN = plan_vision_split(VIDEO, 2, CONFIG)


def _one_line(kind, pattern, call):
    with pytest.raises(kind, match=pattern) as info:
        call()
    assert "\n" not in str(info.value), str(info.value)


def _without(batch, *keys):
    return dataclasses.replace(batch, extras={k: v for k, v in batch.extras.items() if k not in keys})


# --------------------------------------------------------------------------- silently wrong before


def test_a_video_plan_on_an_image_batch_is_refused():
    """Before: zero pixel rows and the video's grid for an image-only batch."""
    assert IMAGE_PLAN.num_tokens == 6 and VIDEO_PLAN.num_tokens == 8
    _one_line(ValueError, r"^batch's image_grid_thw has 2 image\(s\) .* but the plan 0 \[\]",
              lambda: vision_rank_inputs(IMAGES, VIDEO_PLAN, 0))
    # without grids (its pixels only): the pixel rows of each kind against the plan's
    _one_line(ValueError, "^batch's pixel_values has 24 rows but the plan encodes 0 image pixel rows",
              lambda: vision_rank_inputs({"pixel_values": IMAGES.extras["pixel_values"]}, VIDEO_PLAN, 1))
    _one_line(ValueError, "^batch's pixel_values_videos has 0 rows but the plan encodes 32 video pixel rows",
              lambda: vision_rank_inputs({"pixel_values_videos": None}, VIDEO_PLAN, 0))


@settings(**SETTINGS)
@given(rows=st.integers(0, 40).filter(lambda n: n != 6), as_list=st.booleans())
def test_shard_vision_rows_takes_the_plans_rows_only(rows, as_list):
    """Before: 11 embedding rows for a plan of 6 were cut silently (and fewer than 6 an IndexError)."""
    embeds = torch.randn(rows, 3)
    for shard in (IMAGES, thdpack.shard(IMAGES, cp_size=2, cp_rank=1)):
        _one_line(ValueError, f"^embeds has {rows} rows but the plan gathers 6",
                  lambda: shard_vision_rows([embeds] if as_list else embeds, shard, IMAGE_PLAN))


def test_valid_inputs_keep_their_rows():
    embeds = torch.arange(6.0)[:, None]
    assert shard_vision_rows(embeds, IMAGES, IMAGE_PLAN)[:, 0].tolist() == list(range(6))
    parts = [shard_vision_rows([embeds], thdpack.shard(IMAGES, cp_size=2, cp_rank=r), IMAGE_PLAN)[0]
             for r in (0, 1)]
    assert sorted(torch.cat(parts)[:, 0].tolist()) == list(range(6))
    pixels, grid = vision_rank_inputs(IMAGES, IMAGE_PLAN, 0)
    assert pixels.shape[0] == int(grid.prod(1).sum())
    assert vision_rank_inputs(TEXT, plan_vision_split(TEXT, 2, CONFIG), 1) is None  # no vision: nothing to run


def test_a_plan_of_another_pack_is_refused_by_shard_vision_rows():
    _one_line(ValueError, r"^shard's image_grid_thw has 2 image\(s\) .* but the plan 0 \[\]",
              lambda: shard_vision_rows(torch.zeros(8, 3), thdpack.shard(IMAGES, cp_size=2, cp_rank=0), VIDEO_PLAN))
    # shards without their grids: the embedding rows they read against the plan's tokens
    # its 8 video tokens
    shard = _without(thdpack.shard(VIDEO, cp_size=2, cp_rank=1), "image_grid_thw", "video_grid_thw")
    _one_line(ValueError, "^shard reads video embedding rows up to 8 but the plan has 0 video tokens",
              lambda: shard_vision_rows(torch.zeros(6, 3), shard, IMAGE_PLAN))
    whole = _without(IMAGES, "image_grid_thw", "video_grid_thw")
    bigger = plan_vision_split({"image_grid_thw": [[1, 4, 4], [1, 2, 4], [1, 2, 2]]}, 2, CONFIG)
    _one_line(ValueError, "^shard holds 6 image tokens but the plan has 7 image tokens",
              lambda: shard_vision_rows(torch.zeros(7, 3), whole, bigger))


# --------------------------------------------------------------------------- tracebacks before


@pytest.mark.parametrize("call, kind, pattern", [
    (lambda: vision_rank_inputs(TEXT, IMAGE_PLAN, 0), ValueError,
     "^batch's pixel_values has 0 rows but the plan encodes 24 image pixel rows"),
    (lambda: vision_rank_inputs({"image_grid_thw": IMAGES.extras["image_grid_thw"]}, IMAGE_PLAN, 0), ValueError,
     "^batch's pixel_values has 0 rows but the plan encodes 24"),
    (lambda: vision_rank_inputs({"pixel_values": np.zeros((24, 4)), "image_grid_thw": [[1, 4, 4], [1, 2, 4]]},
                                IMAGE_PLAN, 0), TypeError, r"^batch's pixel_values must be a 2-D tensor \[rows, D\]"),
    (lambda: vision_rank_inputs(None, IMAGE_PLAN, 0), TypeError, "^batch must be a VLM ThdBatch"),
    (lambda: vision_rank_inputs(IMAGES, None, 0), TypeError, "^plan must be a VisionSplit"),
    (lambda: vision_rank_inputs(IMAGES, {"cp_size": 2}, 0), TypeError, "^plan must be a VisionSplit"),
    (lambda: shard_vision_rows(torch.zeros(6, 3), None, IMAGE_PLAN), TypeError, "^shard must be a VLM ThdBatch"),
    (lambda: shard_vision_rows(torch.zeros(6, 3), TEXT, IMAGE_PLAN), ValueError,
     "^shard has no mm_token_type_ids: a text batch"),
    (lambda: shard_vision_rows(None, IMAGES, IMAGE_PLAN), TypeError, "^embeds must be a 2-D tensor"),
    (lambda: shard_vision_rows([None], IMAGES, IMAGE_PLAN), TypeError, "^embeds must be a 2-D tensor"),
    (lambda: shard_vision_rows(torch.zeros(6, 3), IMAGES, None), TypeError, "^plan must be a VisionSplit"),
    (lambda: gather_vision_embeddings(torch.zeros(6, 3), None), TypeError, "^plan must be a VisionSplit"),
    (lambda: gather_vision_embeddings(None, IMAGE_PLAN), TypeError, "^local must be a 2-D tensor"),
], ids=["text-batch", "no-pixels", "numpy-pixels", "none-batch", "none-plan", "dict-plan", "none-shard",
        "text-shard", "none-embeds", "list-of-none", "none-plan-rows", "none-plan-gather", "none-local"])
def test_vision_helpers_name_the_argument(call, kind, pattern):
    _one_line(kind, pattern, call)


@settings(**SETTINGS)
@given(rank=st.one_of(st.integers(-5, -1), st.integers(4, 2**70), st.text(max_size=2), st.none()))
def test_vision_rank_inputs_checks_the_rank_first(rank):
    """Before: any rank of a plan without frames gave None."""
    empty = plan_vision_split(TEXT, 4, CONFIG)
    _one_line(ValueError, "^rank must be an integer in \\[0, 4\\)", lambda: vision_rank_inputs(TEXT, empty, rank))


@settings(**SETTINGS)
@given(cp_size=HUGE)
def test_vision_split_cp_size_is_bounded(cp_size):
    """Before: a MemoryError (the split's per-rank cuts)."""
    _one_line(ValueError, f"^cp_size={cp_size} \\(the context-parallel ranks\\) would need .* GiB .* below 2\\*\\*20",
              lambda: plan_vision_split(IMAGES, cp_size, CONFIG))
    assert plan_vision_split(IMAGES, 2**20 - 1, CONFIG).cuts.shape == (2**20,)


@settings(**SETTINGS)
@given(value=NOT_BOOL)
def test_vision_split_placeholder_is_a_bool(value):
    _one_line(TypeError, "^placeholder must be True or False", lambda: plan_vision_split(IMAGES, 2, CONFIG,
                                                                                        placeholder=value))
    assert plan_vision_split(IMAGES, 4, CONFIG, placeholder=np.bool_(False)).placeholder is False


# --------------------------------------------------------------------------- hybrid CP sizes


@settings(**SETTINGS)
@given(world_size=HUGE)
def test_hybrid_world_size_is_bounded(world_size):
    """Before: a MemoryError (plan_hybrid_cp's per-rank loads), a plan whose schedule never ends (from_blocks),
    every power of two up to it (block_sizes)."""
    pattern = f"^world_size={world_size} \\(the data-parallel × context-parallel ranks\\) would need"
    _one_line(ValueError, pattern, lambda: block_sizes(world_size))
    _one_line(ValueError, pattern, lambda: HybridCPPlan.from_blocks([5], [1], [0], world_size))
    _one_line(ValueError, pattern, lambda: plan_hybrid_cp([5, 9], world_size, 32))
    assert block_sizes(2**20 - 2) == (1, 2)


@settings(**SETTINGS)
@given(tp_size=HUGE, pad_multiple=st.integers(2**62, 2**63 - 1).map(lambda m: m | 1))
def test_hybrid_padding_sizes_are_bounded(tp_size, pad_multiple):
    """Before: OverflowError (a padding multiple past int64)."""
    _one_line(ValueError, f"^tp_size={tp_size} \\(the tensor-parallel ranks\\) would need",
              lambda: plan_hybrid_cp([5], 8, 32, tp_size=tp_size, sequence_parallel=True))
    _one_line(ValueError, f"^pad_multiple={pad_multiple} \\(tp_size=1\\): samples on \\d+ ranks would pad to multiples "
              "of .*, past int64 lengths", lambda: plan_hybrid_cp([5], 8, 32, pad_multiple=pad_multiple))


@settings(**SETTINGS)
@given(world_size=st.sampled_from([2, 3, 5, 6, 8, 12, 24, 40]), n=st.integers(1, 12), data=st.data())
def test_every_rank_runs_or_the_plan_is_refused(world_size, n, data):
    """Before: too few samples gave a plan with idle ranks (its contract: every rank runs a micro-batch)."""
    lengths = data.draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    most = block_sizes(world_size)[-1]
    if n * most < world_size:
        _one_line(ValueError, f"^plan_hybrid_cp: {n} sample\\(s\\) .* leave rank \\d+ of the world_size={world_size} "
                  f"ranks without a micro-batch; .* give at least {-(-world_size // most)} samples",
                  lambda: plan_hybrid_cp(lengths, world_size, 32))
    else:
        plan = plan_hybrid_cp(lengths, world_size, 32)
        assert all(plan.rank_micro_batches(r) for r in range(world_size))


@settings(**SETTINGS)
@given(value=NOT_BOOL)
def test_hybrid_booleans_are_bools(value):
    """Before: the string "no" (any value) was read by its truth."""
    _one_line(TypeError, "^sequence_parallel must be True or False",
              lambda: plan_hybrid_cp([5, 7], 2, 32, tp_size=2, sequence_parallel=value))
    _one_line(TypeError, "^pack must be True or False", lambda: plan_hybrid_cp([5, 7], 2, 32, pack=value))
    _one_line(TypeError, "^sequence_parallel must be True or False",
              lambda: HybridCPPlan.from_blocks([5], [1], [0], 1, sequence_parallel=value))
    _one_line(TypeError, "^HybridCP.pack must be True or False", lambda: HybridCP(32, pack=value))
    plan = plan_hybrid_cp([5, 7], 2, 32, tp_size=2, sequence_parallel=np.bool_(True), pack=np.bool_(False))
    assert plan == plan  # numpy bools are bools
    assert plan.padded_lengths.tolist() == plan_hybrid_cp([5, 7], 2, 32, tp_size=2, sequence_parallel=True,
                                                          pack=False).padded_lengths.tolist()


@pytest.mark.parametrize("groups, lengths, kind, pattern", [
    (None, [4], TypeError, "^sample_id_groups must be a list of groups"),
    ("01", [4], TypeError, "^sample_id_groups must be a list of groups"),
    ([[[0], 1]], [4], TypeError, r"^sample_id_groups\[0\] must be a list of per-rank lists"),
    ([[[0], [3]]], [4, 2], ValueError, r"^sample_id_groups\[0\]\[1\]: a sample id must be an integer in \[0, 2\)"),
    ([[[0], [1.0]]], [4, 2], ValueError, r"^sample_id_groups\[0\]\[1\]: a sample id must be an integer"),
    ([[[0], [1]], [[0]]], [4, 2], ValueError, r"^sample_id_groups\[1\] lists 1 ranks, sample_id_groups\[0\] 2"),
    ([[[0]]], None, TypeError, "^lengths must be a list or array"),
    ([[[0]]], [-1], ValueError, "^lengths must be non-negative"),
], ids=["none", "string", "rank-not-a-list", "id-out-of-range", "float-id", "ragged", "no-lengths", "negative"])
def test_schedule_cost_checks_its_schedule(groups, lengths, kind, pattern):
    _one_line(kind, pattern, lambda: schedule_cost(groups, lengths))


def test_hybrid_cp_shard_names_samples():
    _one_line(TypeError, "^samples must be a sequence of samples or a mapping",
              lambda: thdpack.shard(None, plan=plan_hybrid_cp([3], 1, 4), rank=0))


# --------------------------------------------------------------------------- process groups


def _hybrid_shard():
    """A hybrid-CP micro-batch on a block of 2 ranks."""
    plan = HybridCPPlan.from_blocks([6], [2], [0], 2)
    (batch,) = thdpack.shard([{"input_ids": list(range(1, 7))}], plan=plan, rank=1)
    assert batch.shard.cp_size == 2
    return batch


@settings(**SETTINGS)
@given(group=PLAIN)
def test_plain_data_as_a_process_group_is_a_type_error(group):
    """Before: a string as cp_group was stored as the group (a hybrid batch's packed_seq_params, a one-rank vision
    gather) or reached torch.distributed ("Default process group has not been initialized")."""
    samples = [{"input_ids": [1, 2, 3]}]
    what = "must be a torch.distributed process group"
    one = plan_vision_split({"image_grid_thw": [[1, 2, 4]]}, 1, CONFIG)
    _one_line(TypeError, f"^group {what}", lambda: gather_vision_embeddings(torch.zeros(2, 3), one, group))
    _one_line(TypeError, f"^cp_group {what}", lambda: ThdCollator(cp_size=2, cp_group=group))
    _one_line(TypeError, f"^sp_group {what}", lambda: ThdCollator(ulysses_sp_size=2, sp_group=group))
    _one_line(TypeError, f"^group {what}", lambda: rebalance(samples, 8, group=group))
    _one_line(TypeError, f"^group {what}", lambda: rebalance_hybrid_cp(samples, 8, group=group))
    batch = _hybrid_shard()
    _one_line(TypeError, f"^cp_group {what} \\(.*\\), a mapping \\{{cp_size: group\\}}",
              lambda: packed_seq_params_dict(batch, cp_group=group))
    _one_line(TypeError, f"^cp_group's group of 2 ranks {what}",
              lambda: packed_seq_params_dict(batch, cp_group={2: group}))


def test_a_group_object_still_passes():
    fake = object()
    assert packed_seq_params_dict(_hybrid_shard(), cp_group=fake)["cp_group"] is fake
    one = plan_vision_split({"image_grid_thw": [[1, 2, 4]]}, 1, CONFIG)
    x = torch.randn(2, 3)
    assert torch.equal(gather_vision_embeddings(x, one, None), x)
