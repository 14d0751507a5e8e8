"""thdpack.flops at the edges of its inputs (issue 20 point 6): a ``cu_seqlens`` whose real
part holds no tokens beside a micro-batch that does is counted dense (``B·S²``), as
Megatron-LM and Megatron-Bridge count it (``accumulate_flops_metadata`` in Bridge's
``training/utils/flop_utils.py``), or refused where the token count is unknown; and every
count given to ``model_flops`` / ``vision_seqlen_stats`` is an integer >= 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thdpack.flops import FlopsAccumulator, FlopsMeter, model_flops, model_flops_breakdown, seqlen_squared_sum
from thdpack.flops import vision_seqlen_stats

TEXT = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100}
VL = {  # a small Qwen3-VL: a vision tower without attention windows
    "model_type": "qwen3_vl",
    "text_config": dict(TEXT, model_type="qwen3_vl_text"),
    "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
                      "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64,
                      "hidden_act": "gelu_pytorch_tanh", "deepstack_visual_indexes": []},
}
EMPTY = "holds no tokens"


def ids(b: int, s: int) -> torch.Tensor:
    return torch.zeros(b, s, dtype=torch.long)


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


# =========================================================================== empty cu_seqlens, tokens beside


@pytest.mark.parametrize(
    "b,s,packed",
    [
        (1, 256, {"cu_seqlens": i32([0])}),
        (1, 256, {"cu_seqlens": i32([[0, -1, -1]]), "cu_seqlens_argmin": torch.tensor([[1]])}),  # NeMo padding
        (1, 256, {"cu_seqlens": i32([[0, -1, -1]])}),  # no argmin: cut at the first -1 anyway
        (1, 256, {"cu_seqlens": i32([[0, 0, 0]])}),  # segments, but no tokens in them
        (1, 256, {"cu_seqlens": i32([[0, 256, -1]]), "cu_seqlens_unpadded": i32([[0, -1, -1]]),
                  "cu_seqlens_unpadded_argmin": torch.tensor([[1]])}),  # the real part empty, the layout not
        (1, 256, {"cu_seq_lens_q": i32([0])}),  # transformers flash kwargs
        (2, 128, {"cu_seqlens": i32([[0, -1], [0, -1]])}),  # two rows: B·S², not (B·S)²
    ],
)
def test_empty_cu_seqlens_beside_tokens_counts_dense(b, s, packed):
    acc = FlopsAccumulator().add(dict(packed, input_ids=ids(b, s)))
    assert acc.tokens == b * s and acc.seqlen_squared_sum == b * s * s
    assert acc.counts() == FlopsAccumulator().add_bshd(b, s).counts()  # Megatron's mbs · seq_len²
    assert acc.model_flops(TEXT) == model_flops(TEXT, b * s, b * s * s) > 0
    meter = FlopsMeter(TEXT, peak_tflops=1.0)
    meter.update(dict(packed, input_ids=ids(b, s)))
    record = meter.step(1.0)
    assert record["model_flops"] == model_flops(TEXT, b * s, b * s * s) and record["tokens"] == b * s


def test_empty_real_part_with_a_layout_counts_the_layout_dense():
    # seqlen_squared_sum knows the micro-batch's tokens from the layout: T tokens in B rows
    assert seqlen_squared_sum([0, 256], cu_seqlens_unpadded=[0]) == 256**2
    layout, real = i32([[0, 128, -1], [0, 128, -1]]), i32([[0, -1, -1], [0, -1, -1]])
    assert seqlen_squared_sum(layout, cu_seqlens_unpadded=real) == 2 * 128**2
    assert int(seqlen_squared_sum(layout, cu_seqlens_unpadded=real, as_tensor=True)) == 2 * 128**2
    assert seqlen_squared_sum(np.asarray([0, 256]), cu_seqlens_unpadded=np.asarray([0]), as_tensor=True) == 256**2
    acc = FlopsAccumulator().add_cu_seqlens(layout, cu_seqlens_unpadded=real)
    assert acc.counts() == FlopsAccumulator().add_bshd(2, 128).counts()
    acc = FlopsAccumulator().add_cu_seqlens(i32([0]), num_padded_tokens=256)
    assert acc.counts() == FlopsAccumulator().add_bshd(1, 256).counts()
    # a micro-batch with real tokens is counted as before, whatever its layout
    assert seqlen_squared_sum([0, 256], cu_seqlens_unpadded=[0, 100]) == 100**2
    assert FlopsAccumulator().add_cu_seqlens([0, 256], cu_seqlens_unpadded=[0, 100]).seqlen_squared_sum == 100**2


def test_empty_cu_seqlens_without_a_token_count_raises():
    for cu in ([0], [0, 0, 0], i32([[0, -1, -1]])):
        with pytest.raises(ValueError, match=f"cu_seqlens {EMPTY}"):
            seqlen_squared_sum(cu)
    with pytest.raises(ValueError, match=f"cu_seqlens_unpadded {EMPTY}"):
        seqlen_squared_sum(cu_seqlens_unpadded=[0])
    # lazily too, where it shows without reading the values: one entry, or an argmin of 1
    with pytest.raises(ValueError, match=EMPTY):
        seqlen_squared_sum(i32([0]), as_tensor=True)
    with pytest.raises(ValueError, match=EMPTY):
        seqlen_squared_sum(i32([0, -1, -1]), cu_seqlens_argmin=1, as_tensor=True)
    with pytest.raises(ValueError, match="num_padded_tokens"):
        FlopsAccumulator().add_cu_seqlens(i32([0]))
    with pytest.raises(ValueError, match="num_padded_tokens"):
        FlopsAccumulator().add({"cu_seqlens": i32([[0, -1, -1]]), "cu_seqlens_argmin": torch.tensor([[1]])})
    # told that the micro-batch is empty: it adds nothing
    assert not any(FlopsAccumulator().add_cu_seqlens(i32([0]), num_padded_tokens=0).counts().values())
    assert not any(FlopsAccumulator().add_cu_seqlens([0, 0], cu_seqlens_unpadded=[0]).counts().values())


def test_empty_cu_seqlens_on_a_device_is_checked_without_reading_it():
    # a meta tensor has no data: reaching the checks proves that nothing is read back
    with pytest.raises(ValueError, match="num_padded_tokens"):
        FlopsAccumulator().add_cu_seqlens(torch.empty(1, dtype=torch.int32, device="meta"))
    acc = FlopsAccumulator().add_cu_seqlens(torch.empty(9, dtype=torch.int32, device="meta"), num_padded_tokens=256)
    assert acc.seqlen_squared_sum.device.type == "meta" and acc.tokens.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dense_fallback_without_host_sync():
    inputs = {"input_ids": torch.zeros(1, 256, dtype=torch.long, device="cuda"),
              "cu_seqlens": torch.tensor([[0, -1, -1]], dtype=torch.int32, device="cuda")}
    packed = {"input_ids": inputs["input_ids"], "cu_seqlens": torch.tensor([0, 100, 256], dtype=torch.int32,
                                                                              device="cuda")}
    acc, other = FlopsAccumulator(), FlopsAccumulator()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        acc.add(inputs)
        other.add(packed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert acc.counts() == FlopsAccumulator().add_bshd(1, 256).counts()
    assert other.counts()["seqlen_squared_sum"] == 100**2 + 156**2 and other.counts()["samples"] == 2


# =========================================================================== counts are integers >= 0


@pytest.mark.parametrize("name", ["num_tokens", "seqlen_squared_sum", "vision_patches", "vision_seqlen_squared_sum"])
@pytest.mark.parametrize("bad", [-5, 10.5, 10.0, True, "10", torch.tensor(3.0), torch.tensor([1, 2])])
def test_model_flops_counts_must_be_non_negative_integers(name, bad):
    counts = {"num_tokens": 100, "seqlen_squared_sum": 5000, "vision_patches": 64, "vision_seqlen_squared_sum": 4096}
    counts[name] = bad
    for fn in (model_flops, model_flops_breakdown):
        with pytest.raises(ValueError, match=f"^{name} must be an integer >= 0"):
            fn(VL, **counts)


def test_negative_vision_patches_no_longer_give_negative_flops():
    with pytest.raises(ValueError, match="vision_patches must be an integer >= 0, got -5"):
        model_flops(VL, 100, 5000, vision_patches=-5, vision_seqlen_squared_sum=4096)
    with pytest.raises(ValueError, match="vision_window_seqlen_squared_sum"):
        model_flops(VL, 100, 5000, vision_patches=64, vision_seqlen_squared_sum=4096,
                    vision_window_seqlen_squared_sum=-1)


def test_model_flops_takes_every_integer_kind():
    want = model_flops(VL, 100, 5000, vision_patches=64, vision_seqlen_squared_sum=4096)
    assert model_flops(VL, np.int64(100), np.int32(5000), vision_patches=np.int64(64),
                       vision_seqlen_squared_sum=4096) == want
    assert float(model_flops(VL, torch.tensor(100), torch.tensor(5000), vision_patches=64,
                             vision_seqlen_squared_sum=4096)) == float(want)
    assert model_flops(TEXT, 0, 0) == 0
    # an exact Σ sᵢ² past int64 (lengths_squared_sum returns one) is a count, not an error
    big = 3 * 2**63
    per_square = model_flops(TEXT, 0, 1)
    assert model_flops(TEXT, 10, big) == model_flops(TEXT, 10, 0) + per_square * big
    with pytest.raises(ValueError, match="num_tokens"):
        model_flops(TEXT, 2**63, 0)  # a token count is int64, as everywhere in thdpack


@pytest.mark.parametrize(
    "grid,where",
    [([[1, 4, -4]], r"grid_thw\[0, 2\]"), ([[1, 4, 4], [-1, 2, 2]], r"grid_thw\[1, 0\]"),
     ([[1.0, 4, 4]], r"grid_thw\[0, 0\]"), ([[1, 4.5, 4]], r"grid_thw\[0, 0\]"),
     (torch.tensor([[1, 4, 4]], dtype=torch.float32), r"grid_thw\[0, 0\]"),
     (torch.tensor([[2, -8, 8]]), r"grid_thw\[0, 1\]")],
)
def test_grid_thw_entries_must_be_non_negative_integers(grid, where):
    with pytest.raises(ValueError, match=where + " must be an integer >= 0"):
        vision_seqlen_stats(grid)
    with pytest.raises(ValueError, match=where):
        model_flops(VL, 100, 5000, vision_grid_thw=grid)
    with pytest.raises(ValueError, match=where):
        FlopsAccumulator().add_vision(grid)
    with pytest.raises(ValueError, match="rows of 3"):
        vision_seqlen_stats([[1, 4]])
    assert vision_seqlen_stats([]).patches == 0 and vision_seqlen_stats(np.zeros((0, 3), np.int64)).patches == 0


def test_add_bshd_counts_must_be_non_negative_integers():
    with pytest.raises(ValueError, match="micro_batch_size must be an integer >= 0"):
        FlopsAccumulator().add_bshd(-1, 128)
    with pytest.raises(ValueError, match="seq_len must be an integer >= 0"):
        FlopsAccumulator().add_bshd(2, 12.5)
    assert FlopsAccumulator().add_bshd(np.int64(2), 128).seqlen_squared_sum == 2 * 128**2


@pytest.mark.parametrize("kwargs, message", [
    (dict(seconds=float("nan")), r"seconds must be a positive finite number, got nan"),
    (dict(seconds=0.0), r"seconds must be a positive finite number, got 0.0"),
    (dict(seconds=float("inf")), r"seconds must be a positive finite number, got inf"),
    (dict(world_size=0), r"world_size must be an integer >= 1, got 0"),
    (dict(world_size=2.5), r"world_size must be an integer >= 1, got 2.5"),
    (dict(flops=-1.0), r"flops must be a non-negative finite number, got -1.0"),
    (dict(flops=float("nan")), r"flops must be a non-negative finite number, got nan"),
    (dict(peak_tflops=-312.0), r"peak_tflops must be a positive finite number, got -312.0"),
    (dict(peak_tflops=float("nan")), r"peak_tflops must be a positive finite number, got nan"),
])
def test_throughput_refuses_what_is_not_a_count_time_or_peak(kwargs, message):
    """NaN seconds gave a NaN TFLOP/s, a negative peak a negative MFU, world_size 0 a ZeroDivisionError
    (issue 21 point 1): each is a ValueError naming the argument and the value."""
    from thdpack.flops import throughput

    args = dict(flops=1e15, seconds=1.0, world_size=1, peak_tflops=312.0) | kwargs
    with pytest.raises(ValueError, match=message):
        throughput(**args)


def test_flops_meter_checks_world_size_and_the_gpu_when_made():
    from thdpack.flops import FlopsMeter

    config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100, intermediate_size=128)
    with pytest.raises(ValueError, match=r"world_size must be an integer >= 1, got 0"):
        FlopsMeter(config, world_size=0)
    for bad in ("H1OO", "nope", ""):
        with pytest.raises(ValueError, match=rf"^peak_tflops must be .* known GPU name \(A100, A800, .*\), got unknown "
                                             rf"GPU '{bad}'$"):
            FlopsMeter(config, peak_tflops=bad)
    assert FlopsMeter(config, peak_tflops="H100").peak_tflops == 989.0
