"""The number rule over the public API (issue 21 point 1): every count, size, cost, time or scale a
public function takes is checked by one rule (``thdpack.common.align.check_int`` /
``check_number``): a count is an integer >= 0, a size an integer >= 1, a scale a finite real
(> 0 or >= 0). Whatever hypothesis draws outside that (NaN, ±inf, negatives, fractions, bools,
integers past int64, strings) must be a ``ValueError`` / ``TypeError`` whose message names the
argument, never a number, a traceback from deep inside, or a silent default."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thdpack
from thdpack import (
    CostModel,
    StreamingPacker,
    ThdCollator,
    TokenBudgetBatchSampler,
    build_thd_batch,
    cp_pad_multiple,
    local_seq_lens,
    plan_balanced,
    plan_packs,
    thd_partition_indices,
)
from thdpack.batching import BatchLayout
from thdpack.flops import FlopsAccumulator, FlopsMeter, model_flops, overcount_report, seqlen_squared_sum, throughput
from thdpack.losses import packed_loss
from thdpack.planning import PlanOptions
from thdpack.common.align import check_int, is_int
from thdpack.flops import (
    attention_overcount_factor,
    cp_seqlen_squared_share,
    model_overcount_factor,
    vision_seqlen_stats,
)
from thdpack.losses import (
    all_reduce_items,
    dpo_loss,
    group_advantages,
    pair_groups,
    policy_gradient_loss,
    token_logps,
)
from thdpack.offline import ConfigError
from thdpack.offline.inputs.input_slice import InputSlice
from thdpack.offline.stages import check_model_config

RULE = settings(max_examples=25, deadline=None, derandomize=True)

TEXT = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100}
LENGTHS = [3, 5, 2, 7]
SAMPLES = [{"input_ids": list(range(1, n + 1))} for n in LENGTHS]
BATCH = build_thd_batch(SAMPLES)
PAIRS = build_thd_batch(SAMPLES, sample_index=[0, 1, 2, 3])
LOGITS = torch.zeros(BATCH.num_padded_tokens, 16)
ZEROS = torch.zeros(BATCH.num_padded_tokens)
CU = torch.tensor([0, 4, 8], dtype=torch.int32)

# ----------------------------------------------------------------------------- what is outside the rule

_non_finite = st.sampled_from([math.nan, math.inf, -math.inf, np.float64("nan"), np.float32("inf")])
_huge = st.integers(min_value=2**63, max_value=2**80)
_strings = st.sampled_from(["3", "", "nan", "1e3"])
_fractions = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6)  # 2.0 too: not an int
_negative_ints = st.integers(min_value=-(2**70), max_value=-1)
_negative_reals = st.one_of(_negative_ints, st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False))

NOT_A_COUNT = st.one_of(_non_finite, _huge, _strings, _fractions, _negative_ints, st.booleans())
NOT_A_SIZE = st.one_of(NOT_A_COUNT, st.just(0), st.just(np.int64(0)))
NOT_AN_INT64 = st.one_of(_non_finite, _huge, st.integers(max_value=-(2**63) - 1, min_value=-(2**70)), _strings,
                         _fractions, st.booleans())
NOT_NON_NEGATIVE = st.one_of(_non_finite, _strings, _negative_reals, st.booleans())
NOT_POSITIVE = st.one_of(NOT_NON_NEGATIVE, st.just(0), st.just(0.0))
NOT_A_SQUARE_SUM = st.one_of(_non_finite, _strings, _fractions, _negative_ints, st.booleans())  # past int64 is fine
NOT_A_PEAK = st.one_of(_non_finite, _negative_reals, st.booleans(), st.just(0))  # a string is a GPU name

KINDS = {"count": NOT_A_COUNT, "size": NOT_A_SIZE, "int": NOT_AN_INT64, "scale0": NOT_NON_NEGATIVE,
         "scale": NOT_POSITIVE, "square_sum": NOT_A_SQUARE_SUM, "peak": NOT_A_PEAK}


def _loss(**kw):
    return packed_loss(LOGITS, BATCH, **kw)


# (argument named in the message, kind, call with the value). One row per argument of a public function.
CASES = {
    # planning
    "plan_packs.pack_size": ("pack_size", "size", lambda v: plan_packs(LENGTHS, v)),
    "plan_packs.align": ("align", "size", lambda v: plan_packs(LENGTHS, 16, align=v)),
    "plan_packs.max_samples_per_pack": ("max_samples_per_pack", "size",
                                        lambda v: plan_packs(LENGTHS, 16, max_samples_per_pack=v)),
    "plan_packs.seed": ("seed", "count", lambda v: plan_packs(LENGTHS, 16, seed=v)),
    "plan_packs.vision_budget": ("vision_budget", "size",
                                 lambda v: plan_packs(LENGTHS, 16, vision_lengths=[0] * 4, vision_budget=v)),
    "PlanOptions.pack_size": ("pack_size", "size", lambda v: PlanOptions(pack_size=v)),
    "plan_balanced.num_replicas": ("num_replicas", "size", lambda v: plan_balanced(LENGTHS, 16, num_replicas=v)),
    "plan_balanced.micro_batches": ("micro_batches", "size",
                                    lambda v: plan_balanced(LENGTHS, 16, num_replicas=2, micro_batches=v)),
    "plan_balanced.cost.linear": ("linear", "scale0",
                                  lambda v: plan_balanced(LENGTHS, 16, num_replicas=2, cost=(v, 1.0))),
    "plan_balanced.cost.quadratic": ("quadratic", "scale0",
                                     lambda v: plan_balanced(LENGTHS, 16, num_replicas=2, cost=(1.0, v))),
    "CostModel.vision": ("vision", "scale0", lambda v: CostModel(vision=v)),
    # building
    "build_thd_batch.pad_token_id": ("pad_token_id", "count", lambda v: build_thd_batch(SAMPLES, pad_token_id=v)),
    "build_thd_batch.ignore_index": ("ignore_index", "int", lambda v: build_thd_batch(SAMPLES, ignore_index=v)),
    "build_thd_batch.cp_size": ("cp_size", "size", lambda v: build_thd_batch(SAMPLES, cp_size=v)),
    "build_thd_batch.tp_size": ("tp_size", "size", lambda v: build_thd_batch(SAMPLES, tp_size=v)),
    "build_thd_batch.pad_multiple": ("pad_multiple", "size", lambda v: build_thd_batch(SAMPLES, pad_multiple=v)),
    "build_thd_batch.max_length": ("max_length", "size", lambda v: build_thd_batch(SAMPLES, max_length=v)),
    "build_thd_batch.pad_to": ("pad_to", "size", lambda v: build_thd_batch(SAMPLES, pad_to=v)),
    "build_thd_batch.cp_rank": ("cp_rank", "count", lambda v: build_thd_batch(SAMPLES, cp_size=2, cp_rank=v)),
    "BatchLayout.max_length": ("max_length", "size", lambda v: BatchLayout(max_length=v)),
    "cp_pad_multiple.cp_size": ("cp_size", "size", lambda v: cp_pad_multiple(v)),
    "cp_pad_multiple.tp_size": ("tp_size", "size", lambda v: cp_pad_multiple(2, v, sequence_parallel=True)),
    # loaders
    "ThdCollator.pack_size": ("pack_size", "size", lambda v: ThdCollator(pack_size=v)),
    "ThdCollator.seed": ("seed", "count", lambda v: ThdCollator(pack_size=16, seed=v)),
    "ThdCollator.max_length": ("max_length", "size", lambda v: ThdCollator(max_length=v)),
    "TokenBudgetBatchSampler.pack_size": ("pack_size", "size", lambda v: TokenBudgetBatchSampler(LENGTHS, v)),
    "TokenBudgetBatchSampler.num_replicas": ("num_replicas", "size",
                                             lambda v: TokenBudgetBatchSampler(LENGTHS, 16, num_replicas=v, rank=0)),
    "TokenBudgetBatchSampler.rank": ("rank", "count",
                                     lambda v: TokenBudgetBatchSampler(LENGTHS, 16, num_replicas=2, rank=v)),
    "TokenBudgetBatchSampler.micro_batches": ("micro_batches", "size",
                                              lambda v: TokenBudgetBatchSampler(LENGTHS, 16, micro_batches=v)),
    "TokenBudgetBatchSampler.cost": ("quadratic", "scale0",
                                     lambda v: TokenBudgetBatchSampler(LENGTHS, 16, balance="compute", cost=(1.0, v))),
    "TokenBudgetBatchSampler.set_epoch": ("epoch", "count", lambda v: TokenBudgetBatchSampler(LENGTHS, 16).set_epoch(v)),
    "TokenBudgetBatchSampler.step_items": ("step", "count", lambda v: TokenBudgetBatchSampler(LENGTHS, 16).step_items(v)),
    "StreamingPacker.pack_size": ("pack_size", "size", lambda v: StreamingPacker(SAMPLES, v)),
    "StreamingPacker.buffer_size": ("buffer_size", "size", lambda v: StreamingPacker(SAMPLES, 16, buffer_size=v)),
    "StreamingPacker.num_replicas": ("num_replicas", "size",
                                     lambda v: StreamingPacker(SAMPLES, 16, num_replicas=v, rank=0)),
    "StreamingPacker.rank": ("rank", "count", lambda v: StreamingPacker(SAMPLES, 16, num_replicas=2, rank=v)),
    "StreamingPacker.length_fn": ("length_fn", "size",
                                  lambda v: list(StreamingPacker(SAMPLES, 16, length_fn=lambda s, i: v))),
    # CP shards
    "shard.cp_size": ("cp_size", "size", lambda v: thdpack.shard(BATCH, cp_size=v, cp_rank=0)),
    "shard.cp_rank": ("cp_rank", "count", lambda v: thdpack.shard(build_thd_batch(SAMPLES, cp_size=2), cp_size=2, cp_rank=v)),
    "thd_partition_indices.cp_size": ("cp_size", "size", lambda v: thd_partition_indices(CU, v, 0)),
    "thd_partition_indices.cp_rank": ("cp_rank", "count", lambda v: thd_partition_indices(CU, 2, v)),
    "local_seq_lens.cp_rank": ("cp_rank", "count", lambda v: local_seq_lens([3, 4], CU, 2, v)),
    # FLOPs
    "seqlen_squared_sum.cu_seqlens_argmin": ("cu_seqlens_argmin", "count",
                                             lambda v: seqlen_squared_sum([0, 3, 5], cu_seqlens_argmin=v)),
    "cp_seqlen_squared_share.cp_rank": ("cp_rank", "count", lambda v: cp_seqlen_squared_share([3, 4], CU, 2, v)),
    "model_flops.num_tokens": ("num_tokens", "count", lambda v: model_flops(TEXT, v, 100)),
    "model_flops.seqlen_squared_sum": ("seqlen_squared_sum", "square_sum", lambda v: model_flops(TEXT, 10, v)),
    "model_flops.vision_patches": ("vision_patches", "count", lambda v: model_flops(TEXT, 10, 100, vision_patches=v)),
    "vision_seqlen_stats.grid_thw": ("grid_thw[0, ", "count", lambda v: vision_seqlen_stats([[1, v, 4]])),
    "FlopsAccumulator.add_bshd.micro_batch_size": ("micro_batch_size", "count",
                                                   lambda v: FlopsAccumulator().add_bshd(v, 8)),
    "FlopsAccumulator.add_bshd.seq_len": ("seq_len", "count", lambda v: FlopsAccumulator().add_bshd(2, v)),
    "FlopsAccumulator.add_cu_seqlens.num_padded_tokens": (
        "num_padded_tokens", "count", lambda v: FlopsAccumulator().add_cu_seqlens([0, 3], num_padded_tokens=v)),
    "throughput.flops": ("flops", "scale0", lambda v: throughput(v, 1.0)),
    "throughput.seconds": ("seconds", "scale", lambda v: throughput(1e12, v)),
    "throughput.world_size": ("world_size", "size", lambda v: throughput(1e12, 1.0, v)),
    "throughput.peak_tflops": ("peak_tflops", "peak", lambda v: throughput(1e12, 1.0, 1, v)),
    "FlopsMeter.world_size": ("world_size", "size", lambda v: FlopsMeter(TEXT, world_size=v)),
    "FlopsMeter.peak_tflops": ("peak_tflops", "peak", lambda v: FlopsMeter(TEXT, peak_tflops=v)),
    "FlopsMeter.step": ("seconds", "scale", lambda v: FlopsMeter(TEXT).step(v)),
    "overcount_report.pack_len": ("pack_len", "size", lambda v: overcount_report(pack_lengths=[[3, 4]], pack_len=v)),
    "attention_overcount_factor.n_packs": ("n_packs", "count", lambda v: attention_overcount_factor(v, 16, 25)),
    "attention_overcount_factor.pack_len": ("pack_len", "size", lambda v: attention_overcount_factor(2, v, 25)),
    "attention_overcount_factor.seqlen_squared_sum": ("seqlen_squared_sum", "square_sum",
                                                      lambda v: attention_overcount_factor(2, 16, v)),
    "model_overcount_factor.n_packs": ("n_packs", "count", lambda v: model_overcount_factor(TEXT, v, 16, 7, 25)),
    "model_overcount_factor.num_tokens": ("num_tokens", "size", lambda v: model_overcount_factor(TEXT, 2, 16, v, 25)),
    # losses
    "packed_loss.num_items": ("num_items", "scale", lambda v: _loss(num_items=v)),
    "packed_loss.chunk_size": ("chunk_size", "size", lambda v: _loss(chunk_size=v)),
    "token_logps.chunk_size": ("chunk_size", "size", lambda v: token_logps(LOGITS, BATCH, chunk_size=v)),
    "dpo_loss.beta": ("beta", "scale", lambda v: dpo_loss(torch.zeros(4), torch.zeros(4), PAIRS, beta=v)),
    "dpo_loss.num_items": ("num_items", "scale", lambda v: dpo_loss(torch.zeros(4), torch.zeros(4), PAIRS,
                                                                      num_items=v)),
    "policy_gradient_loss.clip": ("clip", "scale0", lambda v: policy_gradient_loss(LOGITS, BATCH, ZEROS, clip=v)),
    "policy_gradient_loss.num_items": ("num_items", "scale",
                                       lambda v: policy_gradient_loss(LOGITS, BATCH, ZEROS, num_items=v)),
    "group_advantages.eps": ("eps", "scale0", lambda v: group_advantages([1.0, 2.0], [0, 0], eps=v)),
    "pair_groups.num_rows": ("num_rows", "count", lambda v: pair_groups(v)),
    "all_reduce_items.count": ("count", "count", lambda v: all_reduce_items(v)),
}

# the model config's numbers: sizes, read by the one rule with the key named
CONFIG_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size")
for _key in CONFIG_SIZES:
    CASES[f"model_flops.config.{_key}"] = (_key, "size", lambda v, k=_key: model_flops({**TEXT, k: v}, 10, 100))


@pytest.mark.parametrize("case", sorted(CASES))
@RULE
@given(data=st.data())
def test_number_rule(case, data):
    """Any value outside the argument's rule is refused by a ValueError / TypeError naming it."""
    name, kind, call = CASES[case]
    value = data.draw(KINDS[kind], label=name)
    with pytest.raises((ValueError, TypeError)) as err:
        call(value)
    message = str(err.value)
    assert name in message, f"{case}: {value!r} gave {type(err.value).__name__}: {message}"
    assert "\n" not in message


@pytest.mark.parametrize("case", sorted(CASES))
def test_number_rule_cases_take_their_valid_values(case):
    """The same calls with a value inside the rule do not raise: the refusals above are the rule's,
    not a broken call."""
    name, kind, call = CASES[case]
    good = {"count": 1, "size": 2, "int": -100, "scale0": 0.5, "scale": 0.5, "square_sum": 2**70, "peak": 989.0}[kind]
    if case in ("model_flops.config.head_dim", "model_flops.config.num_key_value_heads"):
        good = 2
    if case in ("plan_packs.pack_size", "PlanOptions.pack_size", "TokenBudgetBatchSampler.pack_size",
                "StreamingPacker.pack_size", "ThdCollator.pack_size", "build_thd_batch.max_length",
                "BatchLayout.max_length", "ThdCollator.max_length", "overcount_report.pack_len",
                "attention_overcount_factor.pack_len"):
        good = 16
    if case == "build_thd_batch.pad_to":
        good = 32
    if case == "attention_overcount_factor.seqlen_squared_sum":
        good = 25
    if case == "FlopsAccumulator.add_cu_seqlens.num_padded_tokens":
        good = 3
    if case == "model_flops.vision_patches":  # a text model: no vision work
        good = 0
    if case == "shard.cp_size":  # a batch built without CP padding
        good = 1
    if case == "dpo_loss.beta":
        good = 0.1
    if case == "TokenBudgetBatchSampler.rank" or case == "StreamingPacker.rank" or case.endswith("cp_rank"):
        good = 1
    if case == "seqlen_squared_sum.cu_seqlens_argmin":
        good = 2
    if case == "pair_groups.num_rows":
        good = 4
    call(good)


# ----------------------------------------------------------------------------- the listed cases, by value


@pytest.mark.parametrize("cu,message", [
    ([0, 2.5, 5], r"^cu_seqlens must hold integers in int64 range, got 2.5 at \[1\]$"),
    (np.array([0, np.nan, 5]), r"^cu_seqlens must hold integers in int64 range, got nan at \[1\] \(dtype float64\)$"),
    ([0, 3, 1], r"^cu_seqlens must be non-decreasing within its valid entries, got cu_seqlens\[1\] = 3 then "
                r"cu_seqlens\[2\] = 1$"),
    ([[0, 3, 5], [0, 4, 2]], r"^cu_seqlens must be non-decreasing .*cu_seqlens\[1, 1\] = 4 then cu_seqlens\[1, 2\] = 2$"),
    ([5, 8, 10], r"^cu_seqlens\[0\] is 5; cumulative lengths start at 0$"),
])
def test_seqlen_squared_sum_of_bad_offsets(cu, message):
    """Fractional or NaN offsets gave 13 / 'holds no tokens'; now each names the entry (issue 21 point 1)."""
    with pytest.raises(ValueError, match=message):
        seqlen_squared_sum(cu)
    with pytest.raises(ValueError, match=message.replace("cu_seqlens", "cu_seqlens_unpadded")):
        seqlen_squared_sum([0, 10], cu_seqlens_unpadded=cu)


def test_seqlen_squared_sum_argmin():
    with pytest.raises(ValueError, match=r"^cu_seqlens_argmin must be >= 0 .*got -1$"):
        seqlen_squared_sum([0, 3, 5], cu_seqlens_argmin=-1)
    with pytest.raises(ValueError, match=r"^cu_seqlens_argmin must hold integers in int64 range, got 1.5$"):
        seqlen_squared_sum([0, 3, 5], cu_seqlens_argmin=1.5)
    assert seqlen_squared_sum([0, 3, 5, -1], cu_seqlens_argmin=3) == 9 + 4  # NeMo's cut: unchanged


def test_model_flops_zero_heads_is_named_not_a_zero_division():
    with pytest.raises(ValueError, match=r"^the model config's num_attention_heads must be an integer >= 1, got 0$"):
        model_flops({**TEXT, "num_attention_heads": 0}, 10, 100)


@pytest.mark.parametrize("costs", [(-1.0, 0.0), (1.0, math.nan), (math.inf, 0.0), ("1", 0.0), (True, 0.0)])
def test_plan_balanced_refuses_bad_costs(costs):
    with pytest.raises(ValueError, match=r"^CostModel\.(linear|quadratic) must be a non-negative finite number"):
        plan_balanced(LENGTHS, 16, num_replicas=2, cost=costs)


def test_plan_balanced_cost_of_another_type():
    with pytest.raises(TypeError, match=r"^cost must be a CostModel or \(linear, quadratic\), got 'flops'$"):
        plan_balanced(LENGTHS, 16, num_replicas=2, cost="flops")


@pytest.mark.parametrize("length", [2.5, -1, None, 0, True, "3"])
def test_streaming_packer_length_fn_results(length):
    with pytest.raises(ValueError, match=rf"^sample 0: length_fn\(sample, index\) must be an integer >= 1, got "
                                         rf"{length!r} \(the sample's token count\)$"):
        list(StreamingPacker(SAMPLES, 16, length_fn=lambda s, i: length))
    with pytest.raises(TypeError, match=r"^length_fn must be a function \(sample, index\) -> int, got int$"):
        StreamingPacker(SAMPLES, 16, length_fn=5)


@pytest.mark.parametrize("seed", [-1, 1.5, True, 2**63])
def test_plan_seed_is_named(seed):
    with pytest.raises(ValueError, match=rf"^seed must be an integer >= 0.*, got {seed!r}$"):
        plan_packs(LENGTHS, 16, seed=seed)


def test_overcount_of_negative_packs_or_no_tokens():
    with pytest.raises(ValueError, match=r"^n_packs must be an integer >= 0, got -3$"):
        attention_overcount_factor(-3, 16, 25)
    with pytest.raises(ValueError, match=r"^no real tokens"):
        model_overcount_factor(TEXT, 3, 16, 0, 0)
    with pytest.raises(ValueError, match=r"^no real tokens"):
        attention_overcount_factor(3, 16, 0)


def test_valid_inputs_give_what_they_gave():
    """No behaviour change inside the rule: the same numbers as before the checks."""
    assert seqlen_squared_sum([0, 3, 5]) == 13
    assert seqlen_squared_sum(np.array([0, 3, 5], np.uint32)) == 13
    assert attention_overcount_factor(1, 4, 4) == 4.0
    assert group_advantages([1.0, 2.0], [0, 0]).tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-3)
    assert CostModel(1, 2, 0).quadratic == 2


# ----------------------------------------------------------------------------- the rule with an upper bound

PLAN = plan_packs(LENGTHS, 8)
N = len(PLAN)
# (call with the value, the argument as named, minimum, below, hint, error class): every check of a rank or an
# index is check_int's, so every one says "NAME must be an integer in [MINIMUM, BELOW), got VALUE" (issue 30)
BOUNDED = {
    "shard.cp_rank": (lambda v: thdpack.shard(build_thd_batch(SAMPLES, cp_size=2), cp_size=2, cp_rank=v), "cp_rank", 0, 2, "",
                             ValueError),
    "build_thd_batch.cp_rank": (lambda v: build_thd_batch(SAMPLES, cp_size=2, cp_rank=v), "cp_rank", 0, 2, "",
                                ValueError),
    "thd_partition_indices.cp_rank": (lambda v: thd_partition_indices(CU, 2, v), "cp_rank", 0, 2, "", ValueError),
    "shard.sp_rank": (lambda v: thdpack.shard(BATCH, sp_size=2, sp_rank=v), "sp_rank", 0, 2, " (the SP rank)", ValueError),
    "ThdCollator.ulysses_rank": (lambda v: ThdCollator(ulysses_sp_size=2, ulysses_rank=v), "ulysses_rank", 0, 2,
                                 " (the SP rank)", ValueError),
    "TokenBudgetBatchSampler.rank": (lambda v: TokenBudgetBatchSampler(LENGTHS, 16, num_replicas=2, rank=v), "rank",
                                     0, 2, "", ValueError),
    "StreamingPacker.rank": (lambda v: StreamingPacker(SAMPLES, 16, num_replicas=2, rank=v), "rank", 0, 2, "",
                             ValueError),
    "PackPlan.pieces": (lambda v: PLAN.pieces(v), "pack", -N, N,
                        f" (the plan has {N} packs; a negative pack counts from the end)", IndexError),
    "InputSlice.index": (lambda v: InputSlice(v, 3), "--slice: slice index", 0, 3, "", ConfigError),
}
OUTSIDE = {"below": lambda low, below: below, "minimum - 1": lambda low, below: low - 1, "1.5": lambda *_: 1.5,
           "True": lambda *_: True, "'1'": lambda *_: "1", "2**63": lambda *_: 2**63}


@pytest.mark.parametrize("outside", list(OUTSIDE))
@pytest.mark.parametrize("case", sorted(BOUNDED))
def test_a_bounded_integer_is_refused_in_one_form(case, outside):
    """A rank or index outside ``[minimum, below)``, or not an integer, is one message of one form naming
    the argument ("rank must be in [0, 2)" and "cp_rank must be an integer in [0, 2)" disagreed)."""
    call, name, low, below, hint, error = BOUNDED[case]
    value = OUTSIDE[outside](low, below)
    with pytest.raises(error) as err:
        call(value)
    assert str(err.value) == f"{name} must be an integer in [{low}, {below}), got {value!r}{hint}"


@pytest.mark.parametrize("case", sorted(BOUNDED))
def test_a_bounded_integer_takes_its_range(case):
    call, name, low, below, hint, error = BOUNDED[case]
    for value in (low, below - 1, np.int64(below - 1)):
        call(value)


def test_check_int_message_forms():
    """The one rule and its three messages; ``hint`` follows the value, ``error`` is what is raised."""
    with pytest.raises(ValueError, match=r"^rank must be an integer in \[0, 2\), got 2 \(the SP rank\)$"):
        check_int(2, "rank", 0, below=2, hint=" (the SP rank)")
    with pytest.raises(ValueError, match=r"^size must be an integer >= 1, got 0$"):
        check_int(0, "size", 1)
    with pytest.raises(ValueError, match=r"^size must be an integer >= 1 and < 2\*\*63, got 9223372036854775808$"):
        check_int(2**63, "size", 1)
    with pytest.raises(ValueError, match=r"^id must be an integer in int64 range, got 1.5$"):
        check_int(1.5, "id", None)
    with pytest.raises(IndexError, match=r"^k must be an integer in \[-3, 3\), got -4$"):
        check_int(-4, "k", -3, below=3, error=IndexError)
    with pytest.raises(ConfigError, match=r"^where: k must be an integer in \[0, 3\), got 3$"):
        check_int(3, "k", 0, below=3, error=lambda message: ConfigError(f"where: {message}"))
    check_int(np.int64(2), "rank", 0, below=3)
    check_int(-(2**63), "id", None)
    assert is_int(np.uint8(1), 0, 2) and is_int(2**63 - 1, 0) and is_int(-5)
    assert not any([is_int(True), is_int(np.bool_(True)), is_int(2**63), is_int(1.0), is_int(2, 0, below=2),
                    is_int(-1, 0), is_int("1")])


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "64", 2**63])
def test_the_build_model_config_takes_the_one_rule(value):
    """The offline build's model-config check (``check_model_config``) is the same rule as ``config_int``."""
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    check_model_config(config, "model_config x")
    for key in ("hidden_size", "head_dim"):
        with pytest.raises(ConfigError) as err:
            check_model_config({**config, key: value}, "model_config x")
        assert str(err.value).startswith(f"model_config x: '{key}' must be an integer >= 1")
        assert str(err.value).endswith(f", got {value!r}")
