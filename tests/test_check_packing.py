"""``thdpack.check_packing`` (issue 45): a model on a pack vs on each sample alone, layer by layer.

Every family thdpack supports passes on a tiny random model (full attention, every hybrid family of
tests/hybrid_models.py, the Qwen-VL families with an image and a video in the pack), on each attention backend
that runs on the CPU, plain and CP-aligned packs; what is compared inside each model is asserted (a hybrid's
mixers and their convolution and scan steps, a VLM's merged embeddings). Each deliberate break is caught and
named at the module that reads the boundary it lacks: ``seq_idx`` (the convolution), ``cu_seq_lens_q`` (the
Gated DeltaNet scan, under CPU emulations of the CUDA kernels: tests/kernel_emulation.py), positions that do not
restart and a mask lost under ``use_cache`` (the first attention layer), labels across a boundary (the loss),
one sample's mRoPE rows shifted (the first attention layer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_vlm as tv  # noqa: E402
from hybrid_models import available_families, tiny_hybrid  # noqa: E402
from kernel_emulation import emulate_gdn_kernels  # noqa: E402

import thdpack  # noqa: E402
from thdpack.integrations import register_varlen_attention, to_hf_kwargs  # noqa: E402
from thdpack.integrations.hybrid.mixers import MIXER_FAMILIES  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402

VOCAB = 96
VARLEN = register_varlen_attention()
LAYOUTS = [pytest.param({}, id="plain"), pytest.param({"cp_size": 2}, id="cp2")]
TEXT_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
                "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def tiny_text(family: str = "qwen3", attn: str = "sdpa") -> torch.nn.Module:
    config, model = TEXT_CLASSES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, config)(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        initializer_range=0.2, attn_implementation=attn)
    return getattr(transformers, model)(cfg).eval()


def tiny_qwen3(attn: str = "sdpa") -> torch.nn.Module:
    return tiny_text("qwen3", attn)


def samples_of(lengths, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1, VOCAB, n).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]})
    return out


def vlm_samples(family: str, seed: int = 0) -> list[dict]:
    """An image sample, a video sample and a text-only one, as the family's processor gives them."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    spg = torch.tensor([0.5]) if family == "qwen2_5_vl" else None
    return [tv.make_sample(family, [("text", 3), ("image", (1, 4, 4)), ("text", 4)], rng, prompt=1),
            tv.make_sample(family, [("text", 2), ("video", (2, 4, 4)), ("text", 3)], rng, spg=spg, prompt=2),
            tv.make_sample(family, [("text", 5)], rng)]


def first_failure(report):
    """The first failing module across the pack's samples, in execution order; the failure line names it."""
    pack = report.packs[0]
    assert pack.error is None, pack.error
    failures = [s.first_failure for s in pack.samples if s.first_failure]
    assert failures, report.table()
    first = min(failures, key=lambda d: d.order)
    assert f"first differs at {first.name} ({first.kind};" in report.table().splitlines()[-1]
    return first


def assert_mixers_compared(model, report) -> None:
    """Every sequence mixer of ``model`` is compared, with its convolution and scan steps, and so is every
    attention layer; nothing watched was left uncompared."""
    pack = report.packs[0]
    assert pack.skipped == [], pack.skipped
    steps = {"gdn": ("conv", "scan"), "mamba2": ("conv", "scan"), "mamba1": ("conv", "scan"), "shortconv": ("conv",)}
    kinds = {"conv": "convolution", "scan": "scan"}
    mixers = [(n, MIXER_FAMILIES[type(m).__name__]) for n, m in model.named_modules()
              if type(m).__name__ in MIXER_FAMILIES]
    assert mixers
    for name, family in mixers:
        want = {"gdn": "linear attention", "mamba2": "SSM", "mamba1": "SSM", "shortconv": "convolution"}[family.kind]
        assert pack.compared.get(name) == want, (name, pack.compared)
        for step in steps[family.kind]:
            assert pack.compared.get(f"{name}.{step}") == kinds[step], (name, step, pack.compared)
    assert "attention" in pack.compared.values()


# --------------------------------------------------------------------------- every family passes


def test_a_pack_built_by_thdpack_passes_layer_by_layer_with_its_losses_and_gradients():
    report = thdpack.check_packing(tiny_qwen3(), samples_of([5, 9, 3]), grad=True)
    assert report.ok, report.table()
    pack = report.packs[0]
    assert [s.length for s in pack.samples] == [5, 9, 3]
    assert all(s.compared == 2 * 2 + 1 for s in pack.samples)  # 2 layers, 2 attentions, the logits
    assert pack.compared == {"model.layers.0.self_attn": "attention", "model.layers.0": "decoder layer",
                             "model.layers.1.self_attn": "attention", "model.layers.1": "decoder layer"}
    assert {v.name for v in pack.values} == {"loss (token mean)", "loss (sample mean)", "gradients"}
    assert pack.flops.thdpack_gemm == pack.flops.torch_gemm > 0  # the same GEMMs, counted two ways
    assert pack.flops.pack_length > pack.flops.thdpack
    assert report.table().splitlines()[-1].startswith("OK: 1 pack(s)")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa", VARLEN])
@pytest.mark.parametrize("family", sorted(TEXT_CLASSES))
def test_full_attention_families_pass_on_each_cpu_backend(family, attn, layout):
    """Plain packs and CP-aligned ones (pad slots after every sample: never compared)."""
    samples = samples_of([5, 9, 3])
    report = thdpack.check_packing(tiny_text(family, attn), samples, flops=False, **layout)
    assert report.ok, report.table()
    assert report.attention == attn
    assert [s.length for s in report.packs[0].samples] == [5, 9, 3]
    if layout:
        assert thdpack.build_thd_batch(samples, **layout).num_padded_tokens > 17


@pytest.mark.parametrize("family", ["qwen3", "granitemoehybrid"])
def test_flex_attention_passes(family, static_flex_compiles):
    """FlexAttention (compiled on the CPU; two equal lengths keep it to two compiles, shared by both models)."""
    flex = "flex_attention"
    model = tiny_text("qwen3", flex) if family == "qwen3" else tiny_hybrid.__wrapped__(family, flex)
    report = thdpack.check_packing(model, samples_of([6, 6]), flops=False)
    assert report.ok, report.table()


@pytest.mark.parametrize("attn", ["sdpa", "eager", VARLEN])
@pytest.mark.parametrize("family", available_families())
def test_every_hybrid_family_passes_with_its_mixers_and_steps_compared(family, attn):
    """Through ``packed_model`` (which check_packing applies): plain and CP-aligned packs."""
    model = tiny_hybrid.__wrapped__(family, attn)
    for layout in ({}, {"cp_size": 2}):
        report = thdpack.check_packing(model, samples_of([5, 9, 3]), flops=False, **layout)
        assert report.ok, report.table()
        assert_mixers_compared(model, report)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", tv.FAMILIES)
def test_every_qwen_vl_family_passes_with_an_image_and_a_video(family, layout):
    """The packed run: thdpack's batch (``vlm=get_family(config)``); alone: each sample's own pixel values,
    grids and the model's own mRoPE. The merged vision embeddings are compared where the language model gets
    them, then its decoder layers; the vision tower's own modules are not watched."""
    model = tv.tiny_model.__wrapped__(family)
    report = thdpack.check_packing(model, vlm_samples(family), vlm=get_family(model.config), flops=False, **layout)
    assert report.ok, report.table()
    compared = report.packs[0].compared
    assert next(iter(compared.items())) == ("model.language_model.inputs_embeds", "embeddings")
    assert compared["model.language_model.layers.0.self_attn"] == "attention"
    assert not any("visual" in name for name in compared) and report.packs[0].skipped == []


@pytest.mark.parametrize("attn", ["eager", VARLEN])
def test_a_vlm_passes_on_the_other_backends(attn):
    model = tv.tiny_model.__wrapped__("qwen3_vl")
    model.set_attn_implementation(attn)
    report = thdpack.check_packing(model, vlm_samples("qwen3_vl", seed=1), vlm=get_family(model.config), flops=False)
    assert report.ok, report.table()


def test_gradients_of_a_hybrid_and_of_a_hybrid_vlm():
    """grad=True: every parameter's gradient of the token-mean loss, packed vs alone (the ViT's included)."""
    hybrid = tiny_hybrid.__wrapped__("qwen3_5_text")
    report = thdpack.check_packing(hybrid, samples_of([5, 9, 3]), grad=True, flops=False)
    assert report.ok, report.table()
    assert_mixers_compared(hybrid, report)
    torch.manual_seed(1234)
    vlm = transformers.Qwen3_5ForConditionalGeneration(tv.tiny_config("qwen3_5", hybrid=True)).float().eval()
    report = thdpack.check_packing(vlm, vlm_samples("qwen3_5"), vlm=get_family(vlm.config), grad=True, cp_size=2,
                                   flops=False)
    assert report.ok, report.table()
    assert_mixers_compared(vlm, report)
    grads = next(v for v in report.packs[0].values if v.name == "gradients")
    assert grads.alone > 0 and grads.rel < 1e-4


def test_the_vlm_flops_count_the_vision_tower():
    """thdpack's GEMMs of the step (language model and vision tower, from the grids) are torch's."""
    model = tv.tiny_model.__wrapped__("qwen2_5_vl")
    report = thdpack.check_packing(model, vlm_samples("qwen2_5_vl"), vlm=get_family(model.config))
    flops = report.packs[0].flops
    assert report.ok and flops.thdpack_gemm == flops.torch_gemm > 0, report.table()


# --------------------------------------------------------------------------- each break, named where it shows


def test_seq_idx_removed_is_caught_at_the_convolution():
    """Bamba as given (no packed_model) on the CPU: with seq_idx transformers refuses the call (its reference
    path cannot read it); without it the Mamba-2 convolution runs across the samples."""
    samples = samples_of([5, 9, 3])
    assert thdpack.check_packing(tiny_hybrid.__wrapped__("bamba"), samples, flops=False).ok  # thdpack's call
    model = tiny_hybrid.__wrapped__("bamba")
    kwargs = to_hf_kwargs(thdpack.build_thd_batch(samples), attn_implementation="sdpa")
    assert "can't keep packed sequences apart" in thdpack.check_packing(model, samples, batch=kwargs).packs[0].error
    kwargs.pop("seq_idx")
    report = thdpack.check_packing(model, samples, batch=kwargs, flops=False)
    first = first_failure(report)
    assert (first.name, first.kind) == ("model.layers.0.mamba.conv", "convolution")
    assert "has no seq_idx" in report.table().splitlines()[-1]


@pytest.mark.parametrize("family,model_type", [("qwen3_5_text", "qwen3_5"), ("qwen3_next", "qwen3_next")])
def test_cu_seq_lens_q_removed_is_caught_at_the_linear_attention_scan(family, model_type, monkeypatch):
    """Under CPU emulations of the CUDA kernels (as on CUDA with fla and causal-conv1d): exact with every
    boundary, through check_packing's own call (packed_model leaves the layers to the kernels) and with the
    kwargs given to the model as it is; without cu_seq_lens_q the model as given scans the whole stream in its
    Gated DeltaNet layers while their convolution (seq_idx) still holds. (packed_model gives such a call the
    boundary back.)"""
    emulate_gdn_kernels(monkeypatch, model_type)
    samples = samples_of([5, 9, 3])
    prepared = tiny_hybrid.__wrapped__(family)
    report = thdpack.check_packing(prepared, samples, flops=False)
    assert report.ok, report.table()
    assert_mixers_compared(prepared, report)
    kwargs = to_hf_kwargs(thdpack.build_thd_batch(samples), attn_implementation="sdpa")
    without = {k: v for k, v in kwargs.items() if k != "cu_seq_lens_q"}
    assert thdpack.check_packing(prepared, samples, batch=without, flops=False).ok
    model = tiny_hybrid.__wrapped__(family)  # as given: no packed_model
    assert thdpack.check_packing(model, samples, batch=kwargs, flops=False).ok
    report = thdpack.check_packing(model, samples, batch=without, flops=False)
    first = first_failure(report)
    assert (first.name, first.kind) == ("model.layers.0.linear_attn.scan", "scan")
    assert next(iter(report.packs[0].compared)) == "model.layers.0.linear_attn.conv"  # ran first, and held


def test_the_kernel_emulation_is_transformers_own_code_on_one_sequence(monkeypatch):
    """Without boundaries the emulated kernels compute what transformers' reference functions do (so each
    sample alone is still the model's own run); with them, each sample is what it gives alone."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    conv, scan = modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule
    emulate_gdn_kernels(monkeypatch, "qwen3_5")
    torch.manual_seed(0)
    x, w = torch.randn(1, 6, 11), torch.randn(6, 4)
    seq_idx = torch.tensor([[0] * 4 + [1] * 7], dtype=torch.int32)
    torch.testing.assert_close(modeling.causal_conv1d_fn(x, w, activation="silu"), conv(x, w, activation="silu"))
    split = modeling.causal_conv1d_fn(x, w, seq_idx=seq_idx, activation="silu")
    torch.testing.assert_close(split[..., 4:], conv(x[..., 4:], w, activation="silu"))
    q, k, v = (torch.randn(1, 11, 2, 8) for _ in range(3))
    g, beta = -torch.rand(1, 11, 2), torch.rand(1, 11, 2)
    whole = modeling.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    torch.testing.assert_close(whole, scan(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0])
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    parts = modeling.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]
    alone = scan(q[:, 4:], k[:, 4:], v[:, 4:], g=g[:, 4:], beta=beta[:, 4:], use_qk_l2norm_in_kernel=True)[0]
    torch.testing.assert_close(parts[:, 4:], alone)


def test_positions_that_do_not_restart_are_caught_at_the_first_attention_layer():
    """sdpa without a mask or a cache finds the samples where position_ids restart (transformers' own packed
    path, DataCollatorWithFlattening's default call); positions counting on across the samples make it one
    sequence. (Under a document mask RoPE's relative positions would hide the shift.)"""
    model, samples = tiny_qwen3(), samples_of([5, 9, 3])
    kwargs = to_hf_kwargs(thdpack.build_thd_batch(samples), attn_implementation="sdpa")
    kwargs = dict({k: kwargs[k] for k in ("input_ids", "position_ids", "labels")}, use_cache=False)
    assert thdpack.check_packing(model, samples, batch=kwargs, flops=False).ok
    kwargs["position_ids"] = torch.arange(kwargs["input_ids"].shape[1])[None]
    report = thdpack.check_packing(model, samples, batch=kwargs, flops=False)
    first = first_failure(report)
    assert (first.name, first.kind) == ("model.layers.0.self_attn", "attention")
    line = report.table().splitlines()[-1]
    assert line.startswith("FAIL: pack 0, sample 1") and "position_ids that do not count 0, 1, ..." in line


def test_the_mask_dropped_under_use_cache_is_caught_at_the_first_attention_layer():
    """sdpa, the config's use_cache=True, a call without the 4D mask (and without cu_seq_lens, which sdpa does
    not read anyway): transformers masks the row as one sequence."""
    model, samples = tiny_qwen3("sdpa"), samples_of([5, 9, 3])
    kwargs = to_hf_kwargs(thdpack.build_thd_batch(samples), attn_implementation="sdpa")
    assert thdpack.check_packing(model, samples, batch=kwargs, flops=False).ok
    assert model.config.use_cache
    bare = {k: kwargs[k] for k in ("input_ids", "position_ids", "labels")}
    report = thdpack.check_packing(model, samples, batch=bare, flops=False)
    first = first_failure(report)
    assert (first.name, first.kind) == ("model.layers.0.self_attn", "attention")
    assert "use_cache is on" in report.table().splitlines()[-1]


def test_labels_crossing_a_boundary_are_caught_at_the_loss():
    """Labels equal to the ids (no -100 at each sample's first token): the previous sample's last token is
    scored against it; every layer and the logits still agree, the token-mean loss does not."""
    model, samples = tiny_qwen3(), samples_of([5, 9, 3])
    kwargs = to_hf_kwargs(thdpack.build_thd_batch(samples), attn_implementation="sdpa")
    labels = kwargs["labels"].clone()
    for start in (5, 14):
        labels[0, start] = kwargs["input_ids"][0, start]
    report = thdpack.check_packing(model, samples, batch=dict(kwargs, labels=labels), flops=False, grad=True)
    pack = report.packs[0]
    assert all(s.first_failure is None for s in pack.samples)
    failing = [v.name for v in pack.values if not v.ok]
    assert failing[0] == "loss (token mean)" and failing[-1] == "gradients"  # the extra targets move the gradients
    line = report.table().splitlines()[-1]
    assert line.startswith("FAIL: pack 0: loss (token mean) differs") and "scores labels across a boundary" in line


@pytest.mark.parametrize("how", ["rolled a token", "h and w rows swapped"])
def test_one_samples_mrope_rows_shifted_are_caught_at_the_first_attention_layer(how):
    model = tv.tiny_model.__wrapped__("qwen2_5_vl")
    samples = vlm_samples("qwen2_5_vl")
    kwargs = to_hf_kwargs(thdpack.build_thd_batch(samples, vlm=get_family(model.config)), attn_implementation="sdpa")
    assert thdpack.check_packing(model, samples, batch=kwargs, flops=False).ok
    a = len(samples[0]["input_ids"])
    b = a + len(samples[1]["input_ids"])  # the video sample
    rows = kwargs["position_ids"].clone()  # [4, 1, T]: text, then t / h / w
    if how == "rolled a token":
        rows[1:, :, a:b] = rows[1:, :, a:b].roll(1, dims=-1)
    else:
        rows[2:4, :, a:b] = rows[[3, 2], :, a:b]
    report = thdpack.check_packing(model, samples, batch=dict(kwargs, position_ids=rows), flops=False)
    first = first_failure(report)
    assert (first.name, first.kind) == ("model.language_model.layers.0.self_attn", "attention")
    assert report.table().splitlines()[-1].startswith("FAIL: pack 0, sample 1")


def test_a_batch_that_is_not_one_packed_row_is_refused_naming_what_it_takes():
    model, samples = tiny_qwen3(), samples_of([5, 9, 3])
    padded = {"input_ids": torch.zeros(3, 9, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"judges a packed batch, one row .* got input_ids \(3, 9\)"):
        thdpack.check_packing(model, samples, batch=padded)
    short = to_hf_kwargs(thdpack.build_thd_batch(samples[:2]))
    with pytest.raises(ValueError, match=r"3 span\(s\) ending at 17 for 3 sample\(s\) in a row of 14 tokens"):
        thdpack.check_packing(model, samples, batch=short)
