"""Wrong types at the public API (issue 21 point 2): each is one ``ValueError`` / ``TypeError`` that
names the argument, says what it got and what it takes, never an ``AttributeError`` or a numpy /
torch error from inside the library."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import thdpack
from thdpack import (
    SampleError,
    StreamingPacker,
    ThdCollator,
    build_thd_batch,
    local_seq_lens,
    thd_partition_indices,
)
from thdpack.flops import FlopsAccumulator, FlopsMeter, flops_coefficients, model_flops, overcount_report, seqlen_squared_sum
from thdpack.losses import count_items, dpo_loss, packed_loss, group_advantages, policy_gradient_loss, sequence_logps

TEXT = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100}
SAMPLES = [{"input_ids": [1, 2, 3, 4], "reward": 1.0}, {"input_ids": [5, 6, 7], "reward": 0.5}]
BATCH = build_thd_batch(SAMPLES)
LOGITS = torch.zeros(BATCH.num_padded_tokens, 16)


# ----------------------------------------------------------------------------- samples


@pytest.mark.parametrize("samples,got", [(5, "int"), (None, "None"), ("abc", "str"), (b"ab", "bytes"), (3.5, "float")])
@pytest.mark.parametrize("owner,call", [
    ("build_thd_batch", build_thd_batch),
    ("ThdCollator", ThdCollator()),
    ("ThdCollator", ThdCollator(pack_size=16)),
    ("StreamingPacker", lambda s: StreamingPacker(s, 16)),
])
def test_samples_that_are_not_a_list(owner, call, samples, got):
    with pytest.raises(TypeError, match=rf"^{owner} takes a list of samples \(mappings with 'input_ids'\), got {got}$"):
        call(samples)


@pytest.mark.parametrize("owner,call", [("build_thd_batch", build_thd_batch), ("ThdCollator", ThdCollator()),
                                        ("StreamingPacker", lambda s: StreamingPacker(s, 16))])
def test_one_sample_instead_of_a_list(owner, call):
    with pytest.raises(ValueError, match=rf"^{owner} expects a sequence of samples, got a single mapping; pass \[sample\]"):
        call({"input_ids": [1, 2]})


def test_streaming_packer_without_pack_size_names_the_samples_first():
    with pytest.raises(TypeError, match="^StreamingPacker takes a list of samples"):
        StreamingPacker(5)


@pytest.mark.parametrize("ids", [torch.tensor([True, False, True]), np.array([True, False, True]), [True, False, True],
                                 [4, True, 6], [4, 5, False], [0, 1, True]])
@pytest.mark.parametrize("field", ["input_ids", "labels"])
def test_bool_ids_and_labels_are_refused(ids, field):
    sample = {"input_ids": [4, 5, 6], field: ids}
    with pytest.raises(SampleError, match=rf"^sample 0: field '{field}' holds bools; token ids and labels are integers") as err:
        build_thd_batch([sample])
    assert err.value.field == field


@given(st.lists(st.sampled_from([-100, 0, 1, 2, 3]), min_size=1, max_size=40), st.data())
@settings(max_examples=40, deadline=None)
def test_one_bool_anywhere_in_a_list_is_refused(values, data):
    """Token ids 0 and 1 and labels of -100 are integers; a True or False in any slot (equal to 1 or 0) is not."""
    sample = {"input_ids": [abs(v) for v in values], "labels": values}
    assert build_thd_batch([sample]).seq_lens.tolist() == [len(values)]
    field = data.draw(st.sampled_from(["input_ids", "labels"]))
    slot = data.draw(st.integers(0, len(values) - 1))
    sample[field] = list(sample[field])
    sample[field][slot] = data.draw(st.booleans())
    with pytest.raises(SampleError, match=rf"^sample 0: field '{field}' holds bools"):
        build_thd_batch([sample])


def test_bool_loss_mask_is_still_a_mask():
    batch = build_thd_batch([{"input_ids": [4, 5, 6], "loss_mask": [True, True, False]}])
    assert batch.num_targets == 1


def test_object_dtype_ids():
    """An object array of Python ints is read as the ints; one holding anything else names the token."""
    good = build_thd_batch([{"input_ids": np.array([1, 2, 3], dtype=object)}])
    assert good.input_ids.tolist() == [1, 2, 3]
    for bad, shown in ((np.array([1, None, 3], dtype=object), "None at token 1"),
                       (np.array([1, 2.5], dtype=object), "2.5 at token 1"),
                       (np.array([1, "x"], dtype=object), "'x' at token 1")):
        with pytest.raises(SampleError, match=rf"^sample 0: field 'input_ids' must hold integers in int64 range, got {shown}"):
            build_thd_batch([{"input_ids": bad}])


@pytest.mark.parametrize("reward", ["1.0", [1, "a"], None])
def test_rewards_that_are_not_numbers(reward):
    with pytest.raises(SampleError, match=r"^sample 0: 'reward' |^sample 0 has no 'reward' value") as err:
        build_thd_batch([{"input_ids": [1, 2], "reward": reward}], sample_values=["reward"])
    assert err.value.field == "reward"


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), -float("inf"), np.float32("nan"), [1.0, float("nan")]])
def test_non_finite_sample_values_are_refused(reward):
    """Point 1: a NaN / infinite reward is never written into a batch silently."""
    samples = [{"input_ids": [1, 2], "reward": [1.0, 2.0] if isinstance(reward, list) else 1.0},
               {"input_ids": [3, 4], "reward": reward}]
    with pytest.raises(SampleError, match=r"^sample 1: 'reward' is .*; a per-sample value must be finite") as err:
        build_thd_batch(samples, sample_values=["reward"])
    assert err.value.field == "reward"
    with pytest.raises(SampleError, match=r"^sample 1: 'reward' is .*must be finite"):
        ThdCollator(sample_values=["reward"])(samples)


# ----------------------------------------------------------------------------- CP


@pytest.mark.parametrize("batch,got", [({"input_ids": 1}, "dict"), (None, "NoneType"), (torch.zeros(4), "Tensor")])
def test_cp_shard_needs_a_batch(batch, got):
    with pytest.raises(TypeError, match=rf"^shard\(batch, cp_size=, cp_rank=\) takes a thdpack.ThdBatch .*, got {got}; "):
        thdpack.shard(batch, cp_size=2, cp_rank=0)


@pytest.mark.parametrize("cu,shown", [
    ("0,4,8", "got str"), ([0, 4.5, 8], "got 4.5 at \\[1\\]"), (np.array([0.0, 4.0]), "got 0.0 at \\[0\\] \\(dtype float64\\)"),
    (torch.tensor([0.0, 4.0]), "got a torch.float32 tensor"), ([0, True], "got True at \\[1\\]"), (None, "got None"),
    ({"a": 1}, "got dict"),
])
def test_string_and_float_offsets_are_refused(cu, shown):
    for call in (lambda: thd_partition_indices(cu, 1, 0), lambda: local_seq_lens([1], cu, 1, 0)):
        with pytest.raises((ValueError, TypeError), match=rf"^cu_seqlens_padded must .*{shown}"):
            call()
    if cu is None:  # no offsets at all
        shown = None
    for call in (lambda: seqlen_squared_sum(cu), lambda: FlopsAccumulator().add_cu_seqlens(cu, num_padded_tokens=8)):
        with pytest.raises((ValueError, TypeError), match=rf"^cu_seqlens must .*{shown}" if shown else
                           r"^pass cu_seqlens or cu_seqlens_unpadded$"):
            call()


# ----------------------------------------------------------------------------- losses


@pytest.mark.parametrize("logits,got", [({"a": 1}, "dict"), ([[0.0] * 16] * 9, "list"), (np.zeros((9, 16)), "ndarray")])
def test_losses_need_tensor_logits(logits, got):
    for call in (lambda: packed_loss(logits, BATCH), lambda: sequence_logps(logits, BATCH),
                 lambda: policy_gradient_loss(logits, BATCH, torch.zeros(BATCH.num_padded_tokens))):
        with pytest.raises(TypeError, match=rf"^logits must be a float tensor \[T, V\] or \[1, T, V\] .*, got {got}$"):
            call()


@pytest.mark.parametrize("batch,got", [({"labels": 1}, "dict"), (None, "NoneType"), ([BATCH], "list")])
def test_losses_need_a_batch(batch, got):
    for call in (lambda: packed_loss(LOGITS, batch), lambda: dpo_loss(torch.zeros(2), torch.zeros(2), batch)):
        with pytest.raises(TypeError, match=rf"^batch must be a thdpack.ThdBatch .*, got {got}$"):
            call()


def test_meta_device_logits_are_refused():
    meta = torch.empty(BATCH.num_padded_tokens, 16, device="meta")
    with pytest.raises(ValueError, match=r"^logits are on the meta device \(no data\)"):
        packed_loss(meta, BATCH)


@pytest.mark.parametrize("logps,got", [([0.0, 0.0], "list"), ({}, "dict"), (np.zeros(2), "ndarray")])
def test_dpo_loss_needs_tensor_logps(logps, got):
    batch = build_thd_batch(SAMPLES, sample_index=[0, 1])
    with pytest.raises(TypeError, match=rf"^policy_logps must be a float tensor \[n\] .*, got {got}$"):
        dpo_loss(logps, torch.zeros(2), batch)
    with pytest.raises(TypeError, match=rf"^reference_logps must be a float tensor \[n\] .*, got {got}$"):
        dpo_loss(torch.zeros(2), logps, batch)
    with pytest.raises(ValueError, match=r"^policy_logps has dtype torch.int64; expected a float tensor"):
        dpo_loss(torch.zeros(2, dtype=torch.long), torch.zeros(2), batch)


def test_policy_gradient_loss_needs_tensor_advantages():
    with pytest.raises(TypeError, match=r"^advantages must be a float tensor \[T\] .*, got list$"):
        policy_gradient_loss(LOGITS, BATCH, [0.0] * BATCH.num_padded_tokens)
    with pytest.raises(TypeError, match=r"^old_logps must be a float tensor \[T\] .*, got list$"):
        policy_gradient_loss(LOGITS, BATCH, torch.zeros(BATCH.num_padded_tokens), old_logps=[0.0])
    with pytest.raises(ValueError, match=r"^old_logps have shape \(3,\); expected \[T\] = \[7\]"):
        policy_gradient_loss(LOGITS, BATCH, torch.zeros(BATCH.num_padded_tokens), old_logps=torch.zeros(3))


@pytest.mark.parametrize("targets,shown", [
    ({"a": 1}, "sample_targets must be integers .*got dict"),
    ("12", "sample_targets must be integers .*got str"),
    ([1.5, 2.0], "sample_targets must hold integers in int64 range .*got 1.5"),
    (torch.tensor([1.0, 2.0]), "sample_targets must hold integers .*got a torch.float32 tensor"),
    ([-1, 2], r"sample_targets\[0\] is -1, but sample 0 has 3 target tokens in this batch"),
    ([0, 0], r"sample_targets\[0\] is 0, but sample 0 has 3 target tokens in this batch"),
    ([3, 1], r"sample_targets\[1\] is 1, but sample 1 has 2 target tokens in this batch"),
])
def test_sample_targets_below_the_batch_or_of_another_type(targets, shown):
    """Point 1: a negative or zero sample_targets where the sample has targets gave a loss of 0 (or a
    negative mean); every sample's count over the CP group is at least its count here."""
    with pytest.raises((ValueError, TypeError), match=rf"^{shown}"):
        packed_loss(LOGITS, BATCH, "sample", sample_targets=targets)
    assert torch.isfinite(packed_loss(LOGITS, BATCH, "sample", sample_targets=[3, 2]))  # the batch's own counts


def test_count_items_needs_batches():
    with pytest.raises(TypeError, match=r"^count_items takes a list of batches .*got one ThdBatch: pass \[batch\]"):
        count_items(BATCH)
    with pytest.raises(TypeError, match=r"^batches\[1\] must be a thdpack.ThdBatch .*got dict"):
        count_items([BATCH, {}])
    assert count_items([BATCH, BATCH]) == 2 * BATCH.num_targets


@pytest.mark.parametrize("rewards,shown", [(["1", "2"], "got '1'"), ([True, False], "got True"), ("12", "got str"),
                                           (None, "got None$"), ([1.0, None], "got None")])
def test_group_advantages_rewards_are_numbers(rewards, shown):
    with pytest.raises((ValueError, TypeError), match=rf"^rewards must be .*{shown}"):
        group_advantages(rewards, [0, 0])


def test_group_advantages_groups_are_integers():
    with pytest.raises(ValueError, match=r"^groups must hold integers in int64 range, got 0.5 at \[0\]"):
        group_advantages([1.0, 2.0], [0.5, 1.0])


def test_group_advantages_without_spread_is_zero_even_without_eps():
    assert group_advantages([1.0, 1.0, 3.0], [0, 0, 1], eps=0.0).tolist() == [0.0, 0.0, 0.0]


# ----------------------------------------------------------------------------- model configs


@pytest.mark.parametrize("config,got", [(None, "None"), ("qwen3", "str"), (5, "int"), ([TEXT], "list")])
def test_flops_need_a_config(config, got):
    for call in (lambda: model_flops(config, 10, 100), lambda: flops_coefficients(config),
                 lambda: FlopsMeter(config)):
        with pytest.raises(TypeError, match=rf"^config must be a transformers config or its dict .*, got {got}$"):
            call()


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                                 "intermediate_size"])
def test_a_config_without_a_size_names_it(key):
    config = {k: v for k, v in TEXT.items() if k != key}
    with pytest.raises(ValueError, match=rf"^the model config has no {key}; pass a complete config of the model$"):
        model_flops(config, 10, 100)


def test_an_empty_config_names_its_first_missing_key():
    for config in ({}, {"model_type": "llama"}, type("Config", (), {})()):
        with pytest.raises(ValueError, match=r"^the model config has no hidden_size"):
            model_flops(config, 10, 100)


def test_a_vl_config_names_the_sub_config():
    vl = {"model_type": "qwen3_vl", "text_config": {**TEXT, "hidden_size": 0}}
    with pytest.raises(ValueError, match=r"^the model config's text_config.hidden_size must be an integer >= 1, got 0"):
        model_flops(vl, 10, 100)
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64, "patch_size": -16}
    with pytest.raises(ValueError, match=r"^the model config's vision_config.patch_size must be an integer >= 1, got -16"):
        model_flops({**TEXT, "vision_config": vision}, 10, 100, vision_patches=4, vision_seqlen_squared_sum=16)


@pytest.mark.parametrize("value", ["64", 64.0, 2.5, None, -1, 0, True])
def test_config_values_of_another_type(value):
    if value is None:  # a hub config's null: the key is unset
        match = r"^the model config has no num_attention_heads"
    else:
        match = rf"^the model config's num_attention_heads must be an integer >= 1, got {value!r}$"
    with pytest.raises(ValueError, match=match):
        model_flops({**TEXT, "num_attention_heads": value}, 10, 100)


def test_overcount_report_pack_lengths():
    with pytest.raises(TypeError, match=r"^pack_lengths must be a list of per-pack length arrays, got int"):
        overcount_report(pack_lengths=5, pack_len=16)
    with pytest.raises(ValueError, match=r"^pack_lengths\[1\] must hold integers in int64 range, got 2.5"):
        overcount_report(pack_lengths=[[3], [2.5]], pack_len=16)
    with pytest.raises(ValueError, match=r"^no real tokens .*the over-count of a pack-length count is undefined"):
        overcount_report(pack_lengths=[[0], [0]], pack_len=16, config=TEXT)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), np.float32("nan")])
def test_offline_rows_with_non_finite_values_are_row_errors(value):
    """Point 1: an offline build no longer writes a NaN / infinite reward into its packs without a word:
    the row is a row error naming the column (skipped and counted with --skip-bad-rows)."""
    from thdpack.offline.tokenizing.row_conversions import sample_value

    with pytest.raises(ValueError, match=r"^'reward' is (nan|inf|-inf); a per-sample value must be finite"):
        sample_value(value, "reward")
    assert sample_value(0.5, "reward") == (0.5, False) and sample_value(2**70, "reward") == (float(2**70), True)
