"""Bad inputs: every one is a ValueError whose message names the sample index and the field."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

import thdpack
from thdpack import (SampleError, StreamingPacker, ThdCollator, TokenBudgetBatchSampler, build_thd_batch,
                     cp_pad_multiple, plan_packs)

OK = {"input_ids": [1, 2, 3]}


def build(bad, **kw):
    """Build a pack whose sample 1 is ``bad`` (sample 0 and 2 are fine)."""
    return build_thd_batch([OK, bad, OK], **kw)


# --------------------------------------------------------------------------
# per-sample fields
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "labels",
    [[1, 2], [1, 2, 3, 4], np.array([5]), torch.tensor([1, 2, 3, 4, 5])],
    ids=["short", "long", "numpy", "torch"],
)
def test_labels_wrong_length(labels):
    n = len(labels)
    with pytest.raises(ValueError, match=rf"sample 1: 'labels' has {n} values but 'input_ids' has 3"):
        build({"input_ids": [4, 5, 6], "labels": labels})


@pytest.mark.parametrize("mask", [[1, 1], [1, 0, 1, 1], np.ones(2, bool)], ids=["short", "long", "numpy"])
def test_loss_mask_wrong_length(mask):
    with pytest.raises(ValueError, match=rf"sample 1: 'loss_mask' has {len(mask)} values but 'input_ids' has 3"):
        build({"input_ids": [4, 5, 6], "loss_mask": mask})


def test_wrong_length_after_truncation_point_still_detected():
    with pytest.raises(ValueError, match="sample 1: 'labels' has 2 values"):
        build({"input_ids": [4, 5, 6], "labels": [4, 5]}, max_length=2)


@pytest.mark.parametrize(
    "ids",
    [[1.0, 2.0], [1, 2.5], np.array([1.0, 2.0]), torch.tensor([1.0, 2.0]), pa.array([1.5, 2.5])],
    ids=["list-float", "list-mixed", "numpy", "torch", "arrow"],
)
def test_float_ids(ids):
    with pytest.raises(ValueError, match=r"sample 1: field 'input_ids' must hold integers"):
        build({"input_ids": ids})


def test_float_labels():
    with pytest.raises(ValueError, match=r"sample 1: field 'labels' must hold integers"):
        build({"input_ids": [4, 5], "labels": [4.0, -100.0]})


def test_float_loss_mask():
    with pytest.raises(ValueError, match=r"sample 1: field 'loss_mask' must hold integers"):
        build({"input_ids": [4, 5], "loss_mask": [1.0, 0.5]})


@pytest.mark.parametrize("ids", [[4, -3, 5], np.array([4, -3, 5]), torch.tensor([4, -3, 5])], ids=["list", "numpy", "torch"])
def test_negative_ids(ids):
    with pytest.raises(ValueError, match=r"sample 1: 'input_ids' has negative id -3 at token 1"):
        build({"input_ids": ids})


def test_negative_id_in_later_sample_names_that_sample():
    with pytest.raises(ValueError, match=r"sample 2: 'input_ids' has negative id -1 at token 0"):
        build_thd_batch([OK, OK, {"input_ids": [-1, 2]}])


def test_labels_negative_but_not_ignore_index():
    with pytest.raises(ValueError, match=r"sample 1: 'labels' has -5 at token 2.*ignore_index \(-100\)"):
        build({"input_ids": [4, 5, 6], "labels": [-100, 5, -5]})


def test_labels_minus_100_with_other_ignore_index():
    with pytest.raises(ValueError, match=r"sample 1: 'labels' has -100 at token 0.*ignore_index \(-1\)"):
        build({"input_ids": [4, 5, 6], "labels": [-100, 5, 6]}, ignore_index=-1)


@pytest.mark.parametrize("mask", [[1, 2, 0], np.array([1, 2, 0]), torch.tensor([1, 2, 0])], ids=["list", "numpy", "torch"])
def test_loss_mask_value_two(mask):
    with pytest.raises(ValueError, match=r"sample 1: 'loss_mask' has .*2.* at token 1; expected 0 or 1"):
        build({"input_ids": [4, 5, 6], "loss_mask": mask})


def test_loss_mask_negative():
    with pytest.raises(ValueError, match=r"sample 1: 'loss_mask' has .*-1.* at token 0"):
        build({"input_ids": [4, 5, 6], "loss_mask": [-1, 1, 1]})


@pytest.mark.parametrize(
    "ids", [[], np.array([], dtype=np.int64), torch.tensor([], dtype=torch.int64), pa.array([], type=pa.int64())],
    ids=["list", "numpy", "torch", "arrow"],
)
def test_empty_sample(ids):
    with pytest.raises(ValueError, match=r"sample 1: 'input_ids' is empty"):
        build({"input_ids": ids})


@pytest.mark.parametrize("samples", [[], (), iter([])], ids=["list", "tuple", "iterator"])
def test_no_samples(samples):
    with pytest.raises(ValueError, match=r"no samples"):
        build_thd_batch(samples)


@pytest.mark.parametrize("bad", [[1, 2, 3], "abc", 7, None, (1, 2)], ids=["list", "str", "int", "none", "tuple"])
def test_non_mapping_sample(bad):
    with pytest.raises(ValueError, match=rf"sample 1 is a {type(bad).__name__}; expected a mapping with 'input_ids'"):
        build(bad)


def test_single_mapping_instead_of_a_list():
    with pytest.raises(ValueError, match=r"expects a sequence of samples, got a single mapping"):
        build_thd_batch({"input_ids": [1, 2, 3]})


def test_missing_input_ids():
    with pytest.raises(ValueError, match=r"sample 1 has no 'input_ids' field \(fields: \['labels'\]\)"):
        build({"labels": [1, 2]})


def test_two_dimensional_ids():
    with pytest.raises(ValueError, match=r"sample 1: field 'input_ids' must be 1-D, got shape \(2, 2\)"):
        build({"input_ids": torch.tensor([[1, 2], [3, 4]])})


def test_scalar_ids():
    with pytest.raises(ValueError, match=r"sample 1: field 'input_ids' must be 1-D, got shape \(\)"):
        build({"input_ids": 5})


def test_ragged_ids():
    with pytest.raises(ValueError, match=r"sample 1: field 'input_ids' is not a flat sequence of integers"):
        build({"input_ids": [[1, 2], [3]]})


def test_string_ids():
    with pytest.raises(ValueError, match=r"sample 1: field 'input_ids'"):
        build({"input_ids": ["a", "b"]})


def test_collator_reports_bad_sample():
    with pytest.raises(ValueError, match=r"sample 1: 'input_ids' has negative id"):
        ThdCollator()([OK, {"input_ids": [1, -2]}])
    with pytest.raises(ValueError, match=r"sample 1: 'labels' has 1 values"):
        ThdCollator(pack_size=16)([OK, {"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match=r"sample 1 has no 'input_ids' field"):
        ThdCollator(pack_size=16)([OK, {"ids": [1, 2]}])


def test_collator_names_the_bad_sample_by_its_place_in_the_call_not_in_its_pack():
    # one pack: the pack keeps the call order
    bad = {"input_ids": list(range(1, 9)), "labels": [1, 2]}
    with pytest.raises(ValueError, match=r"^sample 2: 'labels' has 2 values .*\(position 2 of pack 0\)$"):
        ThdCollator(pack_size=16)([{"input_ids": [1, 2]}, {"input_ids": [3]}, bad])
    # several packs (12 | 3 + 11 tokens): the bad sample is the first of the second pack
    samples = [{"input_ids": list(range(1, 13))}, {"input_ids": [5, -1, 6]}, {"input_ids": list(range(1, 12))}]
    with pytest.raises(ValueError, match=r"^sample 1: 'input_ids' has negative id -1 .*\(position 0 of pack 1\)$"):
        ThdCollator(pack_size=14)(samples)


# --------------------------------------------------------------------------
# builder options
# --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cp_size", "tp_size"])
@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2"])
def test_bad_cp_tp_size(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be an integer >= 1, got {value!r}"):
        build_thd_batch([OK], **{name: value})
    with pytest.raises(ValueError, match=rf"{name} must be an integer >= 1"):
        ThdCollator(**{name: value})
    with pytest.raises(ValueError, match=rf"{name} must be an integer >= 1"):
        cp_pad_multiple(**{name: value})


@pytest.mark.parametrize("value", [0, 2.0, True, "2"])
def test_bad_cp_size_of_a_shard_has_the_same_message(value):
    """One integer rule (thdpack.common.align.check_int), one message, wherever cp_size is checked."""
    batch = build_thd_batch([OK], cp_size=2)
    with pytest.raises(ValueError, match=rf"^cp_size must be an integer >= 1, got {value!r}$"):
        thdpack.shard(batch, cp_size=value, cp_rank=0)


@pytest.mark.parametrize("value", [0, -16, 2.0, False])
def test_bad_pad_multiple(value):
    with pytest.raises(ValueError, match=r"pad_multiple must be an integer >= 1"):
        build_thd_batch([OK], pad_multiple=value)


def test_bad_fp8():
    with pytest.raises(ValueError, match=r"fp8 must be True, False, None, 'fp8' or 'mxfp8', got 'int4'"):
        cp_pad_multiple(fp8="int4")


@pytest.mark.parametrize("value", [0, -1, True])
def test_bad_max_length(value):
    with pytest.raises(ValueError, match=r"max_length must be an integer >= 1"):
        build_thd_batch([OK], max_length=value)


@pytest.mark.parametrize("value", [2.5, "3"])
def test_non_integer_max_length(value):
    """Like every other size option, a non-integer max_length is a ValueError naming it."""
    with pytest.raises(ValueError, match=r"max_length must be an integer >= 1"):
        build_thd_batch([{"input_ids": [1, 2, 3, 4]}], max_length=value)


def test_sample_index_wrong_length():
    with pytest.raises(ValueError, match=r"sample_index has 1 entries for 2 samples"):
        build_thd_batch([OK, OK], sample_index=[0])


# --------------------------------------------------------------------------
# planning
# --------------------------------------------------------------------------
def test_sample_over_pack_size():
    with pytest.raises(ValueError, match=r"sample 1 has 10 tokens, more than pack_size=8; 2 sample\(s\) are too long"):
        plan_packs([3, 10, 4, 9], 8)


def test_sample_over_pack_size_after_alignment():
    with pytest.raises(ValueError, match=r"sample 2 has 9 tokens \(12 after aligning to 4\), more than pack_size=10"):
        plan_packs([3, 4, 9], 10, align=4)


def test_sample_over_pack_size_in_collator_and_sampler():
    with pytest.raises(ValueError, match=r"sample 1 has 20 tokens.*pack_size=16"):
        ThdCollator(pack_size=16)([OK, {"input_ids": list(range(20))}])
    with pytest.raises(ValueError, match=r"sample 1 has 20 tokens.*pack_size=16"):
        TokenBudgetBatchSampler([3, 20], 16)


@pytest.mark.parametrize("pack_size", [0, -4, 2.5, True, "8", None])
def test_bad_pack_size(pack_size):
    with pytest.raises(ValueError, match=r"pack_size must be an integer >= 1"):
        plan_packs([1, 2], pack_size)
    with pytest.raises(ValueError, match=r"pack_size must be an integer >= 1"):
        TokenBudgetBatchSampler([1, 2], pack_size)


@pytest.mark.parametrize("pack_size", [0, -1])
def test_bad_pack_size_in_collator(pack_size):
    with pytest.raises(ValueError, match=r"pack_size must be an integer >= 1"):
        ThdCollator(pack_size=pack_size)


@pytest.mark.parametrize("align", [0, -1, 1.5])
def test_bad_align(align):
    with pytest.raises(ValueError, match=r"align must be an integer >= 1"):
        plan_packs([1, 2], 8, align=align)


def test_align_over_pack_size():
    with pytest.raises(ValueError, match=r"pack_size \(4\) is smaller than align \(8\); nothing can fit"):
        plan_packs([1, 2], 4, align=8)
    with pytest.raises(ValueError, match=r"pack_size \(4\) is smaller than align \(8\)"):
        TokenBudgetBatchSampler([1, 2], 4, align=8)
    with pytest.raises(ValueError, match=r"pack_size \(6\) is smaller than align \(8\)"):
        ThdCollator(pack_size=6, cp_size=4)


def test_unknown_algorithm():
    with pytest.raises(ValueError, match=r"algorithm must be one of .*'bfd'.*got 'best_fit'"):
        plan_packs([1, 2], 8, algorithm="best_fit")
    with pytest.raises(ValueError, match=r"algorithm must be one of"):
        TokenBudgetBatchSampler([1, 2], 8, algorithm="best_fit")
    with pytest.raises(ValueError, match=r"algorithm must be one of"):
        ThdCollator(pack_size=8, algorithm="best_fit")


def test_unknown_overflow():
    with pytest.raises(ValueError, match=r"overflow must be one of .*got 'clip'"):
        plan_packs([1, 2], 8, overflow="clip")
    with pytest.raises(ValueError, match=r"overflow must be one of"):
        TokenBudgetBatchSampler([1, 2], 8, overflow="clip")
    with pytest.raises(ValueError, match=r"overflow must be one of"):
        ThdCollator(pack_size=8, overflow="clip")


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_bad_max_samples_per_pack(value):
    with pytest.raises(ValueError, match=r"max_samples_per_pack must be an integer >= 1"):
        plan_packs([1, 2], 8, max_samples_per_pack=value)


def test_zero_length():
    with pytest.raises(ValueError, match=r"sample 1 is empty \(length 0\); every sample needs at least one token \(2 such samples\)"):
        plan_packs([3, 0, 2, 0], 8)
    with pytest.raises(ValueError, match=r"sample 1 is empty \(length 0\)"):
        TokenBudgetBatchSampler([3, 0, 2], 8)


def test_negative_length():
    with pytest.raises(ValueError, match=r"sample 2 has negative length -1"):
        plan_packs(np.array([3, 4, -1]), 8)
    with pytest.raises(ValueError, match=r"sample 2 has negative length -1"):
        TokenBudgetBatchSampler([3, 4, -1], 8)


def test_non_integer_lengths():
    with pytest.raises(SampleError, match=r"^sample 1 has length .*2\.5; lengths must be integers") as err:
        plan_packs([3, 2.5], 8)
    assert err.value.sample == 1
    with pytest.raises(SampleError, match=r"^sample 0 has length .*nan; lengths must be integers"):
        plan_packs([float("nan")], 8)
    with pytest.raises(ValueError, match=r"lengths must be integers"):
        plan_packs(["3", "4"], 8)
    with pytest.raises(ValueError, match=r"lengths must be 1-D"):
        plan_packs([[3, 4]], 8)


# --------------------------------------------------------------------------
# sampler
# --------------------------------------------------------------------------
def test_split_in_sampler():
    with pytest.raises(ValueError, match=r"overflow='split' is not possible here"):
        TokenBudgetBatchSampler([3, 40], 16, overflow="split")


@pytest.mark.parametrize("num_replicas, rank", [(0, 0), (2, 2), (2, -1), (1.5, 0)])
def test_bad_replicas(num_replicas, rank):
    with pytest.raises(ValueError, match=r"^(num_replicas must be an integer >= 1|rank must be an integer in \[0, 2\)), got "):
        TokenBudgetBatchSampler([3, 4], 16, num_replicas=num_replicas, rank=rank)


def test_drop_last_with_too_few_packs():
    with pytest.raises(ValueError, match=r"only 1 packs for 2 replicas with drop_last=True"):
        TokenBudgetBatchSampler([3, 4], 16, num_replicas=2, rank=0, drop_last=True)


@pytest.mark.parametrize("call, sample", [
    (lambda: plan_packs([3, 0, 2], 8), 1),
    (lambda: plan_packs([3, 20], 8), 1),
    (lambda: plan_packs([1, 1], 10, vision_lengths=[5, 16], vision_budget=10), 1),
    (lambda: plan_packs([1, 1], 10, vision_lengths=[-1, 1], vision_budget=10), 0),
    (lambda: list(StreamingPacker([{"input_ids": [1]}, {"input_ids": [1] * 9}], 8, num_replicas=1, rank=0)), 1),
])
def test_planners_raise_sample_errors(call, sample):
    """The planners' errors about one sample are SampleErrors carrying its index, like the builder's."""
    with pytest.raises(SampleError, match=rf"^sample {sample} ") as err:
        call()
    assert err.value.sample == sample
