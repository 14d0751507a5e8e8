"""VLM in-batch packing for the Qwen-VL family (thdpack.vlm).

Tiny random-weight transformers models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5),
built from configs (no downloads), fp32, eval mode, sdpa. The reference side never
uses thdpack: every sample runs alone through the model (which computes its own
mRoPE with ``get_rope_index``), and the mRoPE reference is the family's
``get_rope_index`` called on the sample alone.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import thdpack  # noqa: E402
from thdpack import ThdCollator, build_thd_batch, plan_packs  # noqa: E402
from thdpack.planning import binpack as _binpack  # noqa: E402
from thdpack.demo.models import TINY_TEXT  # noqa: E402
from thdpack.vlm import get_family, supported_model_types, vision_lengths  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402
from thdpack.batching import seq_idx

IGNORE = -100
VOCAB = 128
IMG, VID, VS, VE = 120, 121, 118, 119  # image / video placeholder, vision start / end
TEXT_HI = 100  # ordinary text tokens are drawn from [0, TEXT_HI)
PATCH, TPATCH, CHANNELS, MERGE = 2, 2, 3, 2
PIXEL_DIM = CHANNELS * TPATCH * PATCH * PATCH
LOGIT_ATOL = 1e-4
LOSS_ATOL = 1e-5

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
FRAMES_ARE_ITEMS = {"qwen2_vl": False, "qwen2_5_vl": False, "qwen3_vl": True, "qwen3_5": True}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


# --------------------------------------------------------------------------- models


def tiny_config(family: str, hybrid: bool = False):
    """A small config of ``family`` (2 text layers, 2 vision blocks, patch 2, merge 2).

    Qwen3.5: ``hybrid=False`` makes every layer ``full_attention`` (the CPU cannot
    keep packed samples apart in Gated DeltaNet layers); ``hybrid=True`` is its
    linear + full attention layout.
    """
    text = dict(
        vocab_size=VOCAB,
        **TINY_TEXT,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=CHANNELS,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TPATCH,
        out_hidden_size=64,
        initializer_range=0.2,
    )
    tokens = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    if family == "qwen2_vl":
        vision = dict(vision, embed_dim=32, hidden_size=64, mlp_ratio=2)
        for key in ("intermediate_size", "out_hidden_size"):
            vision.pop(key)
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
    elif family == "qwen2_5_vl":
        vision = dict(vision, window_size=8, fullatt_block_indexes=[1], tokens_per_second=3)
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
    elif family == "qwen3_vl":
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True)
        vision = dict(vision, num_position_embeddings=64, deepstack_visual_indexes=[0])
        cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
    elif family == "qwen3_5":
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True, partial_rotary_factor=1.0)
        text.update(
            layer_types=["linear_attention", "full_attention"] if hybrid else ["full_attention"] * 2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        vision = dict(vision, num_position_embeddings=64)
        cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, **tokens)
    else:  # pragma: no cover
        raise ValueError(family)
    cfg._attn_implementation = "sdpa"
    return cfg


MODEL_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
}


@functools.lru_cache(maxsize=None)
def tiny_model(family: str, hybrid: bool = False) -> torch.nn.Module:
    torch.manual_seed(1234)
    model = getattr(transformers, MODEL_CLASSES[family])(tiny_config(family, hybrid))
    return model.to(torch.float32).eval()


# --------------------------------------------------------------------------- samples


def build_ids(family: str, layout, rng) -> list[int]:
    """``layout``: a list of ``("text", n)``, ``("image", grid)``, ``("video", grid)``;
    vision items are wrapped in vision start / end tokens, and a Qwen3-style video
    puts a timestamp (two text tokens) before every frame."""
    ids: list[int] = []
    for kind, value in layout:
        if kind == "text":
            ids += rng.integers(0, TEXT_HI, value).tolist()
        elif kind == "image":
            t, h, w = value
            ids += [VS] + [IMG] * (t * h * w // MERGE**2) + [VE]
        elif FRAMES_ARE_ITEMS[family]:
            t, h, w = value
            for _ in range(t):
                ids += rng.integers(0, TEXT_HI, 2).tolist() + [VS] + [VID] * (h * w // MERGE**2) + [VE]
        else:
            t, h, w = value
            ids += [VS] + [VID] * (t * h * w // MERGE**2) + [VE]
    return ids


def make_sample(family: str, layout, rng, *, spg=None, prompt: int = 0) -> dict:
    """A processor-style sample for ``layout`` with random pixels; labels mask the
    first ``prompt`` tokens and every vision placeholder."""
    ids = build_ids(family, layout, rng)
    images = [v for k, v in layout if k == "image"]
    videos = [v for k, v in layout if k == "video"]
    labels = np.array(ids)
    labels[:prompt] = IGNORE
    labels[np.isin(labels, [IMG, VID])] = IGNORE
    sample = {"input_ids": ids, "labels": labels.tolist()}
    if images:
        sample["image_grid_thw"] = torch.tensor(images)
        sample["pixel_values"] = torch.randn(sum(t * h * w for t, h, w in images), PIXEL_DIM)
    if videos:
        sample["video_grid_thw"] = torch.tensor(videos)
        sample["pixel_values_videos"] = torch.randn(sum(t * h * w for t, h, w in videos), PIXEL_DIM)
        if spg is not None:
            sample["second_per_grid_ts"] = spg
    return sample


def mixed_samples(family: str, seed: int = 0) -> list[dict]:
    """One-image, multi-image, video, image+video and text-only samples."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    spg = torch.tensor([0.5, 2 / 3], dtype=torch.float32) if family == "qwen2_5_vl" else None
    layouts = [
        [("text", 3), ("image", (1, 4, 4)), ("text", 5)],
        [("text", 2), ("image", (1, 2, 6)), ("text", 1), ("image", (1, 4, 2)), ("text", 0), ("image", (1, 6, 4)), ("text", 4)],
        [("text", 7)],
        [("text", 2), ("video", (3, 4, 4)), ("text", 3)],
        [("text", 1), ("image", (1, 2, 2)), ("text", 2), ("video", (2, 2, 6)), ("text", 2), ("video", (1, 4, 2)), ("text", 2)],
        [("text", 4), ("image", (2, 4, 4)), ("text", 3)],
    ]
    out = []
    for i, layout in enumerate(layouts):
        n_videos = sum(k == "video" for k, _ in layout)
        out.append(make_sample(family, layout, rng, spg=spg[:n_videos] if spg is not None and n_videos else None, prompt=i % 3))
    return out


# --------------------------------------------------------------------------- references (no thdpack)


def token_types(ids: torch.Tensor) -> torch.Tensor:
    """What the processor returns as mm_token_type_ids."""
    return (ids == IMG).int() + 2 * (ids == VID).int()


def reference_rope(family_model, sample) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.as_tensor(sample["input_ids"]).reshape(1, -1)
    kw = {k: torch.as_tensor(sample[k]) for k in ("image_grid_thw", "video_grid_thw") if k in sample}
    if "second_per_grid_ts" in sample:
        kw["second_per_grid_ts"] = sample["second_per_grid_ts"]
    pos, delta = family_model.model.get_rope_index(ids, token_types(ids), **kw)
    return pos[:, 0], delta[0, 0]


@torch.no_grad()
def run_alone(model, sample):
    ids = torch.as_tensor(sample["input_ids"]).reshape(1, -1)
    labels = torch.as_tensor(sample["labels"]).reshape(1, -1)
    kw = {
        k: torch.as_tensor(sample[k])
        for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        if k in sample
    }
    if "second_per_grid_ts" in sample:
        kw["second_per_grid_ts"] = sample["second_per_grid_ts"]
    out = model(input_ids=ids, labels=labels, mm_token_type_ids=token_types(ids), use_cache=False, **kw)
    logits = out.logits[0]
    targets = labels[0, 1:]
    ce = F.cross_entropy(logits[:-1], targets, ignore_index=IGNORE, reduction="none")
    return logits, ce, targets != IGNORE


@torch.no_grad()
def assert_equivalent(model, batch, samples) -> float:
    """Logits of every sample and the token-weighted loss agree; returns the max logit diff."""
    out = model(**to_hf_kwargs(batch), use_cache=False)
    packed = out.logits[0]
    worst = 0.0
    ce_sum, n_sum = 0.0, 0
    for i, sample in enumerate(samples):
        logits, ce, scored = run_alone(model, sample)
        a = int(batch.cu_seqlens_padded[i])
        s = int(batch.seq_lens[i])
        assert s == logits.shape[0]
        diff = (packed[a : a + s] - logits).abs().max().item()
        worst = max(worst, diff)
        assert diff < LOGIT_ATOL, f"sample {i}: max abs logit diff {diff}"
        ce_sum += float(ce[scored].sum())
        n_sum += int(scored.sum())
    torch.testing.assert_close(out.loss, torch.tensor(ce_sum / n_sum), rtol=0, atol=LOSS_ATOL)
    return worst


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_alone(family):
    model = tiny_model(family)
    samples = mixed_samples(family)
    batch = build_thd_batch(samples, vlm=get_family(model.config), pad_multiple=4)
    assert_equivalent(model, batch, samples)
    # mRoPE rows and deltas equal get_rope_index sample by sample; pad slots as documented
    rows = batch.token_extras["mrope_position_ids"]
    for i, sample in enumerate(samples):
        ref, delta = reference_rope(model, sample)
        a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        b = int(batch.cu_seqlens_padded[i + 1])
        assert torch.equal(rows[:, a : a + s], ref)
        assert int(batch.extras["rope_deltas"][i]) == int(delta)
        nxt = int(rows[0, a + s - 1]) if int(batch.token_extras["mm_token_type_ids"][a + s - 1]) == 0 else None
        if nxt is not None:  # pads continue the text count after a text token
            assert torch.equal(rows[:, a + s : b], torch.arange(nxt + 1, nxt + 1 + b - a - s).expand(3, -1))


def test_image_processor_outputs_pack():
    """Samples straight from the family's image processor (built locally, no download)."""
    model = tiny_model("qwen2_5_vl")
    proc = transformers.Qwen2VLImageProcessor(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TPATCH, min_pixels=16, max_pixels=256
    )
    rng = np.random.default_rng(5)
    images = [(rng.random(shape) * 255).astype(np.uint8) for shape in [(12, 8, 3), (8, 8, 3), (8, 16, 3)]]
    samples = []
    for group in ([images[0]], [images[1], images[2]], []):
        if not group:
            ids = rng.integers(0, TEXT_HI, 6).tolist()
            samples.append({"input_ids": ids, "labels": ids})
            continue
        out = proc(images=group, return_tensors="pt")
        layout = [("text", 2)]
        for grid in out["image_grid_thw"].tolist():
            layout += [("image", tuple(grid)), ("text", 2)]
        ids = build_ids("qwen2_5_vl", layout, rng)
        samples.append({"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids]), **out})
    batch = build_thd_batch(samples, vlm=get_family(model.config))
    assert batch.extras["pixel_values"].shape[1] == PIXEL_DIM
    assert_equivalent(model, batch, samples)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_equivalence_detects_wrong_positions(family):
    """Negative control: the check is sensitive to the mRoPE rows and to the text row."""
    model = tiny_model(family)
    samples = mixed_samples(family, seed=1)
    batch = build_thd_batch(samples, vlm=get_family(model.config))
    kw = to_hf_kwargs(batch)
    good = model(**kw, use_cache=False).logits
    bad_rows = dict(kw, position_ids=kw["position_ids"][0:1].expand(4, -1, -1))  # text positions as mRoPE
    one_seq = kw["position_ids"].clone()
    one_seq[0, 0] = torch.arange(one_seq.shape[-1])  # no sample boundaries
    with torch.no_grad():
        assert (model(**bad_rows, use_cache=False).logits - good).abs().max() > 100 * LOGIT_ATOL
        assert (model(**dict(kw, position_ids=one_seq), use_cache=False).logits - good).abs().max() > 100 * LOGIT_ATOL


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_qwen3_5_hybrid_on_cpu(attn):
    """Hybrid Qwen3.5-VL (Gated DeltaNet + attention) with images and a video: mRoPE rows still equal
    get_rope_index per sample; the raw call on the CPU is refused by transformers (no kernels to keep
    the samples apart); through ``packed_model`` every sample's logits, the loss and every parameter's
    gradient (the ViT's included) equal it alone, under the default ``use_cache``."""
    from thdpack.integrations import packed_model

    torch.manual_seed(1234)
    model = transformers.Qwen3_5ForConditionalGeneration(tiny_config("qwen3_5", hybrid=True)).float().eval()
    model.set_attn_implementation(attn)
    assert "linear_attention" in model.config.text_config.layer_types
    samples = mixed_samples("qwen3_5", seed=2)
    assert any("pixel_values_videos" in s for s in samples) and any("pixel_values" in s for s in samples)
    batch = build_thd_batch(samples, vlm=get_family(model.config), pad_multiple=2)
    rows = batch.token_extras["mrope_position_ids"]
    for i, sample in enumerate(samples):
        a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        assert torch.equal(rows[:, a : a + s], reference_rope(model, sample)[0])
    kw = to_hf_kwargs(batch, attn_implementation=attn)
    assert torch.equal(kw["cu_seq_lens_q"], batch.cu_seqlens_padded) and torch.equal(kw["seq_idx"], seq_idx(batch))
    with pytest.raises(ValueError, match="can't keep packed sequences apart"), torch.no_grad():
        model(**kw)
    packed_model(model)
    params = [p for p in model.parameters()]
    out = model(**kw)
    got_grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    ce_sum, n_sum = 0.0, 0
    for i, sample in enumerate(samples):
        with torch.no_grad():
            logits, _, _ = run_alone(model, sample)
        a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        diff = (out.logits[0, a : a + s].detach() - logits).abs().max().item()
        assert diff < LOGIT_ATOL, f"sample {i}: max abs logit diff {diff}"
        alone_out = run_alone.__wrapped__(model, sample)  # with gradients: the sample's summed CE
        ce_sum = ce_sum + alone_out[1][alone_out[2]].sum()
        n_sum += int(alone_out[2].sum())
    want_loss = ce_sum / n_sum
    torch.testing.assert_close(out.loss.detach(), want_loss.detach(), rtol=0, atol=LOSS_ATOL)
    want_grads = torch.autograd.grad(want_loss, params, allow_unused=True)
    pairs = [(g, w) for g, w in zip(got_grads, want_grads) if w is not None]
    assert len(pairs) == len(params), "every parameter, the ViT's included, has a gradient alone"
    got_all = torch.cat([g.reshape(-1) for g, _ in pairs])
    want_all = torch.cat([w.reshape(-1) for _, w in pairs])
    assert float((got_all - want_all).abs().max() / want_all.abs().max()) < 1e-5


def test_to_hf_kwargs_layout():
    model = tiny_model("qwen2_5_vl")
    samples = mixed_samples("qwen2_5_vl")
    batch = build_thd_batch(samples, vlm=get_family(model.config))
    kw = to_hf_kwargs(batch)
    T = batch.num_padded_tokens
    assert kw["position_ids"].shape == (4, 1, T)
    assert torch.equal(kw["position_ids"][0, 0], batch.position_ids)
    assert torch.equal(kw["position_ids"][1:, 0], batch.token_extras["mrope_position_ids"])
    assert kw["mm_token_type_ids"].shape == (1, T)
    # vision inputs concatenated in pack order
    assert torch.equal(kw["pixel_values"], torch.cat([s["pixel_values"] for s in samples if "pixel_values" in s]))
    assert torch.equal(
        kw["pixel_values_videos"], torch.cat([s["pixel_values_videos"] for s in samples if "pixel_values_videos" in s])
    )
    assert torch.equal(kw["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in samples if "image_grid_thw" in s]))
    assert torch.equal(kw["video_grid_thw"], torch.cat([s["video_grid_thw"] for s in samples if "video_grid_thw" in s]))
    assert kw["second_per_grid_ts"].dtype == torch.float32 and kw["second_per_grid_ts"].numel() == 3
    # a text-only LLM batch is unchanged
    plain = to_hf_kwargs(build_thd_batch([{"input_ids": [1, 2, 3]}]))
    assert plain["position_ids"].shape == (1, 3) and "mm_token_type_ids" not in plain


def test_vision_metadata():
    from transformers.vision_utils import get_vision_cu_seqlens

    family = "qwen3_vl"
    model = tiny_model(family)
    samples = mixed_samples(family)
    batch = build_thd_batch(samples, vlm=get_family(model.config.to_dict()))
    ex = batch.extras
    grids = torch.cat([ex["image_grid_thw"], ex["video_grid_thw"]])
    assert ex["vision_cu_seqlens"].dtype == torch.int32
    assert torch.equal(ex["vision_cu_seqlens"], get_vision_cu_seqlens(grids))
    n_img_segments = ex["num_image_segments"]
    assert torch.equal(ex["vision_cu_seqlens"][: n_img_segments + 1], get_vision_cu_seqlens(ex["image_grid_thw"]))
    assert ex["vision_max_seqlen"] == int((grids[:, 1] * grids[:, 2]).max())
    assert torch.equal(ex["image_patch_counts"], ex["image_grid_thw"].prod(-1))
    assert ex["sample_vision_patches"].tolist() == vision_lengths(samples).tolist()
    assert int(ex["sample_vision_patches"].sum()) == ex["pixel_values"].shape[0] + ex["pixel_values_videos"].shape[0]
    assert ex["image_sample_index"].tolist() == [0, 1, 1, 1, 4, 5]
    assert ex["video_sample_index"].tolist() == [3, 4, 4]
    types = batch.token_extras["mm_token_type_ids"]
    assert types.dtype == torch.int32
    assert int((types == 1).sum()) == int(ex["image_patch_counts"].sum()) // MERGE**2
    assert int((types == 2).sum()) == int(ex["video_patch_counts"].sum()) // MERGE**2


def test_dict_config_needs_no_transformers():
    """The core builds a VLM batch from a config dict with transformers unimportable: the family resolved
    from the dict (``thdpack.vlm.get_family``) and handed to the builder."""
    cfg = tiny_config("qwen2_5_vl").to_dict()
    code = f"""
import sys
sys.modules["transformers"] = None  # any import of transformers fails
import torch
from thdpack import build_thd_batch
from thdpack.vlm import get_family
cfg = {cfg!r}
s = {{"input_ids": [1, {VS}] + [{IMG}] * 4 + [{VE}, 2], "image_grid_thw": [[1, 4, 4]],
      "pixel_values": torch.zeros(16, {PIXEL_DIM})}}
b = build_thd_batch([s, {{"input_ids": [3, 4]}}], vlm=get_family(cfg))
print(b.token_extras["mrope_position_ids"].tolist())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([[0, 1, 2, 2, 2, 2, 4, 5, 0, 1], [0, 1, 2, 2, 3, 3, 4, 5, 0, 1], [0, 1, 2, 3, 2, 3, 4, 5, 0, 1]])


# --------------------------------------------------------------------------- mRoPE property test


@st.composite
def layouts(draw, max_items: int = 4):
    layout = [("text", draw(st.integers(0, 3)))]
    for _ in range(draw(st.integers(0, max_items))):
        kind = draw(st.sampled_from(["image", "video"]))
        t = 1 if kind == "image" and draw(st.booleans()) else draw(st.integers(1, 4))
        grid = (t, MERGE * draw(st.integers(1, 4)), MERGE * draw(st.integers(1, 4)))
        layout += [(kind, grid), ("text", draw(st.integers(0, 3)))]
    if all(k == "text" for k, _ in layout) and layout[0][1] == 0:
        layout[0] = ("text", 1)
    return layout


SPG_KINDS = ("none", "f32_tensor", "f64_tensor", "floats", "ints", "numpy")


def _spg(kind: str, values: list[float]):
    if kind == "f32_tensor":
        return torch.tensor(values, dtype=torch.float32)
    if kind == "f64_tensor":
        return torch.tensor(values, dtype=torch.float64)
    if kind == "floats":
        return [float(v) for v in values]
    if kind == "ints":
        return [int(round(v)) + 1 for v in values]
    if kind == "numpy":
        return np.asarray(values, dtype=np.float64)
    return None


@settings(max_examples=100, **SETTINGS)
@given(
    family=st.sampled_from(FAMILIES + ("qwen3_5_hybrid",)),
    packs=st.lists(layouts(), min_size=1, max_size=4),
    spg_kind=st.sampled_from(SPG_KINDS),
    seconds=st.lists(st.sampled_from([0.5, 1.0, 2 / 3, 0.4, 1 / 3, 1.25, 0.1, 7 / 30]), min_size=8, max_size=8),
    pad_multiple=st.sampled_from([1, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_mrope_matches_get_rope_index(family, packs, spg_kind, seconds, pad_multiple, seed):
    hybrid = family == "qwen3_5_hybrid"
    family = "qwen3_5" if hybrid else family
    model = tiny_model(family, hybrid)
    rng = np.random.default_rng(seed)
    samples = []
    for layout in packs:
        ids = build_ids(family, layout, rng)
        s = {"input_ids": ids}
        images = [v for k, v in layout if k == "image"]
        videos = [v for k, v in layout if k == "video"]
        if images:
            s["image_grid_thw"] = images
            s["pixel_values"] = np.zeros((sum(t * h * w for t, h, w in images), PIXEL_DIM), np.float32)
        if videos:
            s["video_grid_thw"] = torch.tensor(videos)
            s["pixel_values_videos"] = torch.zeros(sum(t * h * w for t, h, w in videos), PIXEL_DIM)
            spg = _spg(spg_kind, seconds[: len(videos)])
            if spg is not None:
                s["second_per_grid_ts"] = spg
        samples.append(s)
    batch = build_thd_batch(samples, vlm=get_family(model.config), pad_multiple=pad_multiple)
    rows = batch.token_extras["mrope_position_ids"]
    fam = get_family(model.config)
    for i, sample in enumerate(samples):
        ref, delta = reference_rope(model, sample)
        a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        assert torch.equal(rows[:, a : a + s], ref), (i, sample)
        assert int(batch.extras["rope_deltas"][i]) == int(delta)
        # the per-sample API agrees too
        single = fam.mrope_positions(
            sample["input_ids"], sample.get("image_grid_thw"), sample.get("video_grid_thw"), sample.get("second_per_grid_ts")
        )
        assert np.array_equal(single, ref.numpy())


@pytest.mark.parametrize("spg_kind", SPG_KINDS)
def test_qwen2_5_temporal_positions_round_like_torch(spg_kind):
    """``trunc(k · tokens_per_second · second_per_grid_ts)`` in torch's arithmetic:
    with tokens_per_second = 3 these seconds give different integers in float32 and
    float64, and again for a float32 tensor (s rounded before the product)."""
    model = tiny_model("qwen2_5_vl")
    assert model.config.vision_config.tokens_per_second == 3
    seconds = [13 / 9, 25 / 9, 26 / 9, 50 / 9]
    layout = [("text", 2)]
    for _ in seconds:
        layout += [("video", (4, 2, 2)), ("text", 1)]
    rng = np.random.default_rng(0)
    samples = [make_sample("qwen2_5_vl", layout, rng, spg=_spg(spg_kind, seconds)), {"input_ids": [1, 2, 3]}]
    batch = build_thd_batch(samples, vlm=get_family(model.config), pad_multiple=4)
    ref, _ = reference_rope(model, samples[0])
    assert torch.equal(batch.token_extras["mrope_position_ids"][:, : ref.shape[1]], ref)


# --------------------------------------------------------------------------- CP


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_cp_shards_of_vlm_batch(family):
    model = tiny_model(family)
    samples = mixed_samples(family, seed=3)
    cp = 2
    batch = build_thd_batch(samples, vlm=get_family(model.config), cp_size=cp)
    assert_equivalent(model, batch, samples)  # CP padding keeps equivalence
    types = batch.token_extras["mm_token_type_ids"]
    # vision embeddings scattered into the global stream before the split (rows = embedding ids)
    n_img, n_vid = int((types == 1).sum()), int((types == 2).sum())
    stream = torch.full((batch.num_padded_tokens,), -1)
    stream[types == 1] = torch.arange(n_img)
    stream[types == 2] = 1000 + torch.arange(n_vid)
    seen = []
    for rank in range(cp):
        shard = thdpack.shard(batch, cp_size=cp, cp_rank=rank)
        idx = shard.shard.partition_indices
        seen.append(idx)
        for key, value in batch.token_extras.items():
            assert torch.equal(shard.token_extras[key], value[..., idx])
        ltypes = shard.token_extras["mm_token_type_ids"]
        assert torch.equal(shard.extras["vision_token_positions"], idx[ltypes != 0])
        assert torch.equal(shard.extras["image_embed_index"], stream[idx][ltypes == 1])
        assert torch.equal(shard.extras["video_embed_index"] + 1000, stream[idx][ltypes == 2])
        kw = to_hf_kwargs(shard)
        assert kw["position_ids"].shape == (4, 1, batch.num_padded_tokens // cp)
        assert torch.equal(kw["position_ids"][1:, 0], batch.token_extras["mrope_position_ids"][:, idx])
        assert "vision_token_positions" not in batch.extras  # the whole batch is untouched
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(batch.num_padded_tokens))


# --------------------------------------------------------------------------- planning with a vision budget


ALGORITHMS = ("bfd", "ffd", "first_fit_shuffle", "sequential")


@settings(max_examples=60, **SETTINGS)
@given(
    data=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 90)), min_size=0, max_size=60),
    pack_size=st.integers(60, 130),
    vision_budget=st.integers(90, 200),
    algorithm=st.sampled_from(ALGORITHMS),
    align=st.sampled_from([1, 2, 4]),
    max_items=st.sampled_from([None, 1, 3]),
)
def test_plan_within_both_budgets(data, pack_size, vision_budget, algorithm, align, max_items):
    lengths = np.array([d[0] for d in data], dtype=np.int64)
    vision = np.array([d[1] for d in data], dtype=np.int64)
    plan = plan_packs(
        lengths,
        pack_size,
        algorithm=algorithm,
        align=align,
        max_samples_per_pack=max_items,
        vision_lengths=vision,
        vision_budget=vision_budget,
        seed=7,
    )
    assert sorted(plan.sample_index.tolist()) == list(range(len(data)))  # every sample once
    assert np.array_equal(plan.vision_length, vision[plan.sample_index])
    for k in range(len(plan)):
        aligned = -(-plan.pack_lengths(k) // align) * align
        assert aligned.sum() <= pack_size
        assert plan.pack_vision(k).sum() <= vision_budget
        if max_items:
            assert plan.pack(k).size <= max_items
    if len(data):
        assert plan.stats.vision_patches == int(vision.sum())
        assert plan.stats.max_pack_vision <= vision_budget
        assert plan.stats.lower_bound >= -(-int(vision.sum()) // vision_budget)
    # zero vision patches: the same plan as without a vision budget
    flat = plan_packs(lengths, pack_size, algorithm=algorithm, align=align, max_samples_per_pack=max_items, seed=7)
    zero = plan_packs(
        lengths, pack_size, algorithm=algorithm, align=align, max_samples_per_pack=max_items, seed=7,
        vision_lengths=np.zeros_like(lengths), vision_budget=1,
    )
    assert np.array_equal(flat.sample_index, zero.sample_index)
    assert np.array_equal(flat.pack_offsets, zero.pack_offsets)


def _naive_first_fit_2d(sizes, vsizes, cap, vcap, max_items):
    rooms, counts, out = [], [], []
    for s, v in zip(sizes, vsizes):
        for b, (r, vr) in enumerate(rooms):
            if r >= s and vr >= v and (not max_items or counts[b] < max_items):
                break
        else:
            rooms.append((cap, vcap))
            counts.append(0)
            b = len(rooms) - 1
        rooms[b] = (rooms[b][0] - s, rooms[b][1] - v)
        counts[b] += 1
        out.append(b)
    return out


@settings(max_examples=60, **SETTINGS)
@given(
    items=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30)), min_size=0, max_size=3000),
    max_items=st.sampled_from([0, 2, 5]),
)
def test_first_fit_2d_is_first_fit(items, max_items):
    sizes = np.array([i[0] for i in items], dtype=np.int64)
    vsizes = np.array([i[1] for i in items], dtype=np.int64)
    bins, nbins = _binpack.first_fit_2d(sizes, vsizes, 20, 30, max_items)
    assert bins.tolist() == _naive_first_fit_2d(sizes.tolist(), vsizes.tolist(), 20, 30, max_items)
    assert nbins == (int(bins.max()) + 1 if len(items) else 0)


def test_plan_vision_overflow():
    lengths = [10, 50, 10, 80]
    vision = [0, 5, 300, 0]
    with pytest.raises(ValueError, match=r"sample 2 has 300 vision patches, more than vision_budget=100"):
        plan_packs(lengths, 64, vision_lengths=vision, vision_budget=100)
    plan = plan_packs(lengths, 64, vision_lengths=vision, vision_budget=100, overflow="drop")
    assert plan.dropped.tolist() == [2, 3] and plan.stats.samples_dropped == 2
    with pytest.raises(ValueError, match=r"sample 1 has 50 tokens.*5 vision patches.*cannot be truncate"):
        plan_packs(lengths, 40, vision_lengths=vision, vision_budget=400, overflow="truncate")
    # text-only samples may still be split
    plan = plan_packs([10, 90], 40, vision_lengths=[6, 0], vision_budget=8, overflow="split")
    assert plan.stats.samples_split == 1 and sorted(set(plan.sample_index.tolist())) == [0, 1]
    assert plan.vision_length.sum() == 6
    with pytest.raises(ValueError, match="pass both or neither"):
        plan_packs(lengths, 64, vision_lengths=vision)
    with pytest.raises(ValueError, match="one entry per sample"):
        plan_packs(lengths, 64, vision_lengths=[1, 2], vision_budget=10)
    with pytest.raises(ValueError, match="sample 1 has negative vision length"):
        plan_packs(lengths, 100, vision_lengths=[0, -1, 0, 0], vision_budget=10)


def test_plan_then_build_vlm():
    """The plan's packs build into VLM batches that stay within both budgets."""
    family = "qwen2_vl"
    cfg = tiny_config(family)
    samples = mixed_samples(family) * 3
    lengths = [len(s["input_ids"]) for s in samples]
    plan = plan_packs(lengths, 96, vision_lengths=vision_lengths(samples), vision_budget=80)
    for k in range(len(plan)):
        batch = build_thd_batch(plan.gather(samples, k), vlm=get_family(cfg), sample_index=plan.pack(k))
        assert batch.num_tokens <= 96
        assert int(batch.extras["sample_vision_patches"].sum()) <= 80


# --------------------------------------------------------------------------- bad input


def _img_sample(grid=(1, 4, 4), tokens=None, rows=None):
    t, h, w = grid
    n_tok = t * h * w // MERGE**2 if tokens is None else tokens
    return {
        "input_ids": [1, VS] + [IMG] * n_tok + [VE, 2],
        "image_grid_thw": [list(grid)],
        "pixel_values": torch.zeros(t * h * w if rows is None else rows, PIXEL_DIM),
    }


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_bad_input(family):
    cfg = tiny_config(family)
    ok = {"input_ids": [5, 6, 7]}
    build = functools.partial(build_thd_batch, vlm=get_family(cfg))

    # placeholder count does not match its grid
    two = _img_sample()
    two["input_ids"] = [1, VS] + [IMG] * 4 + [VE, 3, VS] + [IMG] * 5 + [VE]
    two["image_grid_thw"] = [[1, 4, 4], [1, 4, 4]]
    two["pixel_values"] = torch.zeros(32, PIXEL_DIM)
    with pytest.raises(ValueError, match=r"sample 1: image 1 has 5 placeholder tokens .* \[1, 4, 4\] gives 1·4·4/2² = 4"):
        build([ok, two])
    with pytest.raises(ValueError, match=r"sample 0: its input_ids have 1 run\(s\) of image placeholder tokens .* describes 2 images"):
        build([dict(two, input_ids=[1, VS] + [IMG] * 8 + [VE])])
    # grid without pixel values, and the reverse
    with pytest.raises(ValueError, match=r"sample 1: 'image_grid_thw' describes 1 image\(s\) \(16 patches\) but the sample has no 'pixel_values'"):
        build([ok, {k: v for k, v in _img_sample().items() if k != "pixel_values"}])
    with pytest.raises(ValueError, match=r"sample 0: 'pixel_values' has 16 rows of patches but no 'image_grid_thw'"):
        build([{k: v for k, v in _img_sample().items() if k != "image_grid_thw"}])
    # pixel rows do not match the grid's patches
    with pytest.raises(ValueError, match=r"sample 2: 'pixel_values' has 15 rows but 'image_grid_thw' gives 16 patches"):
        build([ok, ok, _img_sample(rows=15)])
    # a placeholder with no grid at all
    with pytest.raises(ValueError, match=r"sample 0: its input_ids have 1 run\(s\) of video placeholder tokens \(id 121\)"):
        build([{"input_ids": [1, VID, 2]}])
    # video frame mismatch names the video (and the frame where frames are items)
    vid = {"input_ids": build_ids(family, [("video", (2, 4, 4))], np.random.default_rng(0)),
           "video_grid_thw": [[3, 4, 4]], "pixel_values_videos": torch.zeros(48, PIXEL_DIM)}
    if FRAMES_ARE_ITEMS[family]:
        match = r"sample 0: .* 2 run\(s\) of video placeholder tokens .* describes 3 video frames"
    else:
        match = r"sample 0: video 0 has 8 placeholder tokens .* \[3, 4, 4\] gives 3·4·4/2² = 12"
    with pytest.raises(ValueError, match=match):
        build([vid])
    # grid not a multiple of the merge size
    with pytest.raises(ValueError, match=r"sample 0: image 0 has image_grid_thw row \[1, 3, 4\]"):
        build([_img_sample(grid=(1, 3, 4), tokens=3)])
    # a pad token that the model would take for a placeholder
    with pytest.raises(ValueError, match=rf"pad slot 3 \(after sample 0\) holds vision token id {IMG}"):
        build([ok], pad_multiple=4, pad_token_id=IMG)
    # max_length truncation that cuts placeholders says so
    with pytest.raises(ValueError, match="max_length truncation"):
        build([_img_sample()], max_length=4)


def test_bad_config_and_video_support():
    with pytest.raises(ValueError, match=r"unknown VLM model_type 'llava'.*qwen2_5_vl"):
        build_thd_batch([{"input_ids": [1]}], vlm=get_family({"model_type": "llava"}))
    with pytest.raises(ValueError, match="has no 'model_type'"):
        build_thd_batch([{"input_ids": [1]}], vlm=get_family({"image_token_id": 3}))
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"} <= set(supported_model_types())
    # a config without video (video_token_id: null) rejects video inputs, naming the numbers
    cfg = dict(tiny_config("qwen2_vl").to_dict(), video_token_id=None)
    video = {"input_ids": [1, 2], "video_grid_thw": [[2, 4, 4]], "pixel_values_videos": torch.zeros(32, PIXEL_DIM)}
    with pytest.raises(ValueError, match=r"sample 1: has video inputs \('video_grid_thw' with 1 videos, 'pixel_values_videos' with 32 rows\) but the model config \(qwen2_vl\) has no video token"):
        build_thd_batch([{"input_ids": [3]}, video], vlm=get_family(cfg))
    # second_per_grid_ts must have one value per video
    s = make_sample("qwen2_5_vl", [("video", (2, 2, 2))], np.random.default_rng(0), spg=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"sample 0: 'second_per_grid_ts' has 2 values but 'video_grid_thw' has 1 videos"):
        build_thd_batch([s], vlm=get_family(tiny_config("qwen2_5_vl")))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_collator_with_a_vlm_family(family):
    """ThdCollator(vlm=get_family(...)) gives the same VLM batch as build_thd_batch, also as a
    CP shard (cp_rank) and when planning packs under a vision budget."""
    model = tiny_model(family)
    samples = mixed_samples(family, seed=5)
    whole = build_thd_batch(samples, vlm=get_family(model.config), cp_size=2)
    batch = ThdCollator(vlm=get_family(model.config), cp_size=2)(samples)
    for key in ("input_ids", "labels", "position_ids", "cu_seqlens_padded"):
        assert torch.equal(getattr(batch, key), getattr(whole, key))
    for key, value in whole.token_extras.items():
        assert torch.equal(batch.token_extras[key], value)
    shard = ThdCollator(vlm=get_family(model.config), cp_size=2, cp_rank=1)(samples)
    expected = thdpack.shard(whole, cp_size=2, cp_rank=1)
    assert torch.equal(shard.input_ids, expected.input_ids)
    assert torch.equal(shard.token_extras["mrope_position_ids"], expected.token_extras["mrope_position_ids"])
    assert torch.equal(shard.extras["vision_token_positions"], expected.extras["vision_token_positions"])

    patches = vision_lengths(samples)
    budget = int(patches.max())
    packs = ThdCollator(vlm=get_family(model.config), pack_size=4096, vision_budget=budget)(samples)
    assert sorted(i for b in packs for i in b.sample_index.tolist()) == list(range(len(samples)))
    for b in packs:
        assert int(patches[b.sample_index.numpy()].sum()) <= budget
        assert_equivalent(model, b, [samples[i] for i in b.sample_index.tolist()])
