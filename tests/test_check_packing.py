"""``thdpack.check_packing`` (issue 45): a model on a pack vs on each sample alone, layer by layer.

A tiny random Qwen3 passes through the call the README gives; a pack whose positions do not restart is
caught at the first attention layer, with what it reads and what the call lacks named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import thdpack  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402

VOCAB = 96


def tiny_qwen3(attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2,
                                   attn_implementation=attn)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def samples_of(lengths, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1, VOCAB, n).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]})
    return out


def test_a_pack_built_by_thdpack_passes_layer_by_layer_with_its_losses_and_gradients():
    report = thdpack.check_packing(tiny_qwen3(), samples_of([5, 9, 3]), grad=True)
    assert report.ok, report.table()
    pack = report.packs[0]
    assert [s.length for s in pack.samples] == [5, 9, 3]
    names = {s.worst.name for s in pack.samples} | {d for s in pack.samples for d in [s.worst.kind]}
    assert all(s.compared == 2 * 2 + 1 for s in pack.samples), names  # 2 layers, 2 attentions, the logits
    assert {v.name for v in pack.values} == {"loss (token mean)", "loss (sample mean)", "gradients"}
    assert pack.flops.thdpack_gemm == pack.flops.torch_gemm > 0  # the same GEMMs, counted two ways
    assert pack.flops.pack_length > pack.flops.thdpack
    assert report.table().splitlines()[-1].startswith("OK: 1 pack(s)")


def test_positions_that_do_not_restart_are_caught_at_the_first_attention_layer():
    model, samples = tiny_qwen3(), samples_of([5, 9, 3])
    kwargs = to_hf_kwargs(thdpack.build_thd_batch(samples))
    kwargs["position_ids"] = torch.arange(kwargs["input_ids"].shape[1])[None]
    report = thdpack.check_packing(model, samples, batch=kwargs, flops=False)
    assert not report.ok
    first = min((s.first_failure for s in report.packs[0].samples if s.first_failure), key=lambda d: d.order)
    assert (first.name, first.kind) == ("model.layers.0.self_attn", "attention")
    line = report.table().splitlines()[-1]
    assert line.startswith("FAIL: pack 0, sample 1") and "position_ids that do not count 0, 1, ..." in line
