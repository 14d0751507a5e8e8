"""Omni thinkers on a pack (issue 48): text, image, video, audio and audio-in-video samples packed with
``build_thd_batch(samples, vlm=get_family(thinker.config))`` give, through ``model(**to_hf_kwargs(batch))``, every
sample's logits, the loss and every parameter's gradient (the audio and vision towers' included) that the thinker
gives on each sample alone, called the way its processor's output is (``attention_mask``, the thinker computing
its own TMRoPE); the positions equal its ``get_rope_index`` sample by sample."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from thdpack import SampleError, build_thd_batch  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402
from test_omni_rope import _Processor  # noqa: E402  (the processor's own audio-in-video layout)

IGNORE = -100
MEL = 16
AUDIO, IMAGE, VIDEO, VSTART, VEND, ASTART, AEND = 300, 301, 302, 303, 304, 305, 306
LOGIT_ATOL = 1e-4
GRAD_RTOL = 1e-5


def tiny_thinker(attn: str = "sdpa", family: str = "qwen2_5_omni"):
    if family == "qwen3_omni_moe":
        return tiny_qwen3_thinker(attn)
    cfg = transformers.Qwen2_5OmniThinkerConfig(
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=MEL,
                          n_window=4, output_dim=64, max_source_positions=200),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0], window_size=16,
                           in_channels=3),
        text_config=dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
        vision_end_token_id=VEND, audio_start_token_id=ASTART, audio_end_token_id=AEND, position_id_per_seconds=25,
        seconds_per_chunk=2,
    )
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.Qwen2_5OmniThinkerForConditionalGeneration(cfg).float().eval()


def tiny_qwen3_thinker(attn: str = "sdpa"):
    """A tiny Qwen3-Omni-MoE thinker (MoE text layers, deepstack vision, the real n_window 50: its length rule
    assumes 13 tokens per 100-frame chunk)."""
    cfg = transformers.Qwen3OmniMoeThinkerConfig(
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=MEL,
                          output_dim=64, max_source_positions=64, n_window=50, n_window_infer=800,
                          downsample_hidden_size=8, conv_chunksize=500),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           deepstack_visual_indexes=[0], patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                           in_channels=3),
        text_config=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=400, head_dim=16,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
        vision_end_token_id=VEND, audio_start_token_id=ASTART, audio_end_token_id=AEND, position_id_per_seconds=25,
    )
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.Qwen3OmniMoeThinkerForConditionalGeneration(cfg).float().eval()


def audio_tokens(frames: int, family: str = "qwen2_5_omni") -> int:
    """The model's own rule: Qwen2.5-Omni's audio tower (two stride-2 steps), Qwen3-Omni's
    ``_get_feat_extract_output_lengths`` (chunks of 100 frames, 13 tokens each, then the tail)."""
    if family == "qwen3_omni_moe":
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths
        return int(_get_feat_extract_output_lengths(torch.tensor([frames]), 50)[0])
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def text(rng, n: int) -> list[int]:
    return rng.integers(1, 290, n).tolist()


def make_sample(rng, parts: list, family: str = "qwen2_5_omni") -> dict:
    """A processor-style sample of ``parts``: ("text", n), ("audio", frames), ("image", (h, w)), ("video", (t, h, w),
    seconds per grid)."""
    ids, clips, images, videos, spg = [], [], [], [], []
    for part in parts:
        kind = part[0]
        if kind == "text":
            ids += text(rng, part[1])
        elif kind == "audio":
            clips.append(torch.randn(MEL, part[1]))
            ids += [ASTART] + [AUDIO] * audio_tokens(part[1], family) + [AEND]
        elif kind == "image":
            h, w = part[1]
            images.append((1, h, w))
            ids += [VSTART] + [IMAGE] * (h * w // 4) + [VEND]
        elif kind == "video":
            t, h, w = part[1]
            videos.append((t, h, w))
            spg.append(part[2])
            ids += [VSTART] + [VIDEO] * (t * h * w // 4) + [VEND]
        elif kind == "audio_in_video":  # the video's audio interleaved with its frames, as the processor lays it out
            (t, h, w), seconds, frames = part[1], part[2], part[3]
            videos.append((t, h, w))
            spg.append(seconds)
            clips.append(torch.randn(MEL, frames))
            if family == "qwen3_omni_moe":
                layout = _Processor(2, transformers.Qwen3OmniMoeProcessor).audio_in_video(
                    (t, h, w), seconds, audio_tokens(frames, family), position_id_per_seconds=25)
            else:
                layout = _Processor(2, transformers.Qwen2_5OmniProcessor).audio_in_video(
                    (t, h, w), seconds, audio_tokens(frames), position_id_per_seconds=25, seconds_per_chunk=2)
            chars = {"B": ASTART, "E": AEND, "v": VIDEO, "a": AUDIO}
            ids += [VSTART] + [chars[c] for c in layout] + [VEND]
    sample = {"input_ids": torch.tensor(ids)}
    if any(p[0] == "audio_in_video" for p in parts):
        sample["use_audio_in_video"] = True
    labels = sample["input_ids"].clone()
    labels[(labels >= AUDIO)] = IGNORE
    sample["labels"] = labels
    if clips:
        width = max(c.shape[1] for c in clips)
        feats = torch.zeros(len(clips), MEL, width)
        mask = torch.zeros(len(clips), width, dtype=torch.long)
        for k, c in enumerate(clips):
            feats[k, :, : c.shape[1]] = c
            mask[k, : c.shape[1]] = 1
        sample["input_features"], sample["feature_attention_mask"] = feats, mask
    if images:
        grid = torch.tensor(images)
        sample["image_grid_thw"] = grid
        sample["pixel_values"] = torch.randn(int(grid.prod(1).sum()), 3 * 2 * 4 * 4)
    if videos:
        grid = torch.tensor(videos)
        sample["video_grid_thw"] = grid
        sample["pixel_values_videos"] = torch.randn(int(grid.prod(1).sum()), 3 * 2 * 4 * 4)
        sample["video_second_per_grid"] = torch.tensor(spg, dtype=torch.float32)
    return sample


MIXED = [
    [("text", 9)],
    [("text", 3), ("audio", 37), ("text", 5)],
    [("text", 2), ("image", (4, 4)), ("text", 3), ("audio", 8), ("text", 2)],
    [("audio", 9), ("audio", 23), ("text", 4)],
    [("text", 4), ("video", (2, 4, 4), 0.5), ("text", 3)],
    [("text", 2), ("audio", 16), ("video", (3, 2, 4), 2.0), ("image", (2, 2)), ("text", 2)],
    [("text", 3), ("audio_in_video", (4, 2, 4), 1.5, 90), ("text", 2)],
    [("text", 2), ("image", (2, 4)), ("audio_in_video", (2, 4, 4), 0.5, 21), ("text", 3)],
]
# Qwen3-Omni: clips of 100 frames or more (its tower pads every chunk of a call to the widest: shorter clips pack
# exactly only beside clips of their own length, test_qwen3_unequal_short_clips_are_refused); a video whose
# seconds give fractional positions (0.3 s · 25 = 7.5: the model's own rows are float32)
MIXED_QWEN3 = [
    [("text", 9)],
    [("text", 3), ("audio", 150), ("text", 5)],
    [("text", 2), ("image", (4, 4)), ("text", 3), ("audio", 100), ("text", 2)],
    [("text", 4), ("video", (2, 4, 4), 0.3), ("text", 3), ("audio", 230)],
    [("text", 3), ("audio_in_video", (4, 2, 4), 1.5, 260), ("text", 2)],
]
CASES = {"qwen2_5_omni": (MIXED, 7), "qwen3_omni_moe": (MIXED_QWEN3, 4)}

ALONE_KEYS = ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
              "video_grid_thw", "video_second_per_grid")


def run_alone(model, sample):
    """The thinker on one sample, as its processor's output is passed: ``attention_mask`` given, so it computes its
    own TMRoPE; returns (logits [s, V], the sample's summed token CE, scored tokens)."""
    ids = sample["input_ids"].reshape(1, -1)
    kw = {k: sample[k] for k in ALONE_KEYS if k in sample}
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                use_audio_in_video=sample.get("use_audio_in_video", False), **kw)
    logits = out.logits[0]
    targets = sample["labels"][1:]
    ce = F.cross_entropy(logits[:-1], targets, ignore_index=IGNORE, reduction="sum")
    return logits, ce, int((targets != IGNORE).sum())


def reference_positions(model, sample) -> torch.Tensor:
    ids = sample["input_ids"].reshape(1, -1)
    lengths = sample["feature_attention_mask"].sum(-1) if "feature_attention_mask" in sample else None
    pos, _ = model.model.get_rope_index(ids, sample.get("image_grid_thw"), sample.get("video_grid_thw"),
                                        torch.ones_like(ids), sample.get("use_audio_in_video", False), lengths,
                                        sample.get("video_second_per_grid"))
    return pos[:, 0]


@pytest.mark.parametrize("family,attn", [("qwen2_5_omni", "sdpa"), ("qwen2_5_omni", "eager"),
                                         ("qwen3_omni_moe", "sdpa"), ("qwen3_omni_moe", "eager")])
def test_packed_thinker_equals_each_sample_alone(family, attn):
    model = tiny_thinker(attn, family)
    rng = np.random.default_rng(0)
    mixed, clips = CASES[family]
    samples = [make_sample(rng, parts, family) for parts in mixed]
    batch = build_thd_batch(samples, vlm=get_family(model.config), pad_multiple=4)
    rows = batch.token_extras["mrope_position_ids"]
    for i, sample in enumerate(samples):
        a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        assert torch.equal(rows[:, a: a + s], reference_positions(model, sample)), f"sample {i}"
    params = list(model.parameters())
    kw = to_hf_kwargs(batch, attn_implementation=attn)
    assert kw["input_features"].shape[0] == clips and kw["feature_attention_mask"].shape == kw["input_features"].shape[::2]
    out = model(**kw, use_cache=False)
    got = torch.autograd.grad(out.loss, params, allow_unused=True)
    ce_sum, n_sum = 0.0, 0
    for i, sample in enumerate(samples):
        logits, ce, n = run_alone(model, sample)
        a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        diff = (out.logits[0, a: a + s].detach() - logits.detach()).abs().max().item()
        assert diff < LOGIT_ATOL, f"sample {i}: max abs logit diff {diff}"
        assert diff / logits.abs().max().item() < 1e-5, f"sample {i}: relative logit diff"
        ce_sum, n_sum = ce_sum + ce, n_sum + n
    want_loss = ce_sum / n_sum
    torch.testing.assert_close(out.loss.detach(), want_loss.detach(), rtol=0, atol=1e-5)
    want = torch.autograd.grad(want_loss, params, allow_unused=True)
    names = [n for n, _ in model.named_parameters()]
    unused = [n for n, g, w in zip(names, got, want) if w is None]
    assert [n for n, g in zip(names, got) if g is None] == unused  # the same parameters take part, packed or alone
    assert set(unused) <= {"model.audio_tower.audio_bos_eos_token.weight"}, unused  # the thinker never reads it
    pairs = [(g, w) for g, w in zip(got, want) if w is not None]
    used = [n for n, w in zip(names, want) if w is not None]
    assert any(n.startswith("model.audio_tower") for n in used) and any(n.startswith("model.visual") for n in used)
    got_all = torch.cat([g.reshape(-1) for g, _ in pairs])
    want_all = torch.cat([w.reshape(-1) for _, w in pairs])
    assert float((got_all - want_all).abs().max() / want_all.abs().max()) < GRAD_RTOL


def test_wrong_audio_placeholder_count_names_the_sample():
    model = tiny_thinker()
    rng = np.random.default_rng(1)
    good = make_sample(rng, [("text", 3), ("audio", 20), ("text", 2)])
    bad = make_sample(rng, [("text", 3), ("audio", 20), ("text", 2)])
    ids = bad["input_ids"].tolist()
    ids.remove(AUDIO)  # one placeholder short
    bad = {**bad, "input_ids": torch.tensor(ids), "labels": torch.tensor(ids)}
    with pytest.raises(SampleError, match=r"sample 1: has 4 audio placeholder tokens .* make 5"):
        build_thd_batch([good, bad], vlm=get_family(model.config))


def test_qwen3_unequal_short_clips_are_refused():
    """Qwen3-Omni's audio tower pads every chunk of a call to the widest and its convolutions read that padding
    (tests/test_omni_audio.py shows the leak with the model's own code): a 50-frame clip beside a 150-frame one
    would not be exact, so the pack is refused, naming both clips; equal short clips pack."""
    model = tiny_thinker(family="qwen3_omni_moe")
    rng = np.random.default_rng(2)
    short = make_sample(rng, [("text", 3), ("audio", 50)], "qwen3_omni_moe")
    long = make_sample(rng, [("audio", 150), ("text", 2)], "qwen3_omni_moe")
    family = get_family(model.config)
    with pytest.raises(ValueError, match=r"clip 0 of sample 0 \(50 frames\) and clip 0 of sample 1 \(150 frames\)"):
        build_thd_batch([short, long], vlm=family)
    twin = make_sample(rng, [("audio", 50), ("text", 4)], "qwen3_omni_moe")
    batch = build_thd_batch([short, twin], vlm=family)
    out = model(**to_hf_kwargs(batch), use_cache=False)
    for i, sample in enumerate([short, twin]):
        logits, _, _ = run_alone(model, sample)
        a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        assert (out.logits[0, a: a + s] - logits).abs().max().item() < LOGIT_ATOL


def test_flops_accumulator_counts_the_audio_encoder_of_a_pack():
    """FlopsAccumulator(thinker config).add(batch) counts the audio tower once per batch (one encoder call, its
    chunks padded to the call's widest) beside the text and vision work: what model_flops gives for the batch's
    clips and grids, and more than the same batch without audio counts."""
    from thdpack.flops import FlopsAccumulator, model_flops

    model = tiny_thinker()
    rng = np.random.default_rng(0)
    batch = build_thd_batch([make_sample(rng, parts) for parts in MIXED], vlm=get_family(model.config))
    acc = FlopsAccumulator(model.config).add(batch)
    counts = acc.counts()
    assert counts["audio_clips"] == 7 and counts["audio_frames"] == int(batch.extras["audio_feature_lengths"].sum())
    grids = torch.cat([batch.extras["image_grid_thw"], batch.extras["video_grid_thw"]])
    lens = batch.seq_lens
    want = model_flops(model.config, int(lens.sum()), int((lens * lens).sum()), vision_grid_thw=grids,
                       audio_feature_lengths=batch.extras["audio_feature_lengths"])
    assert acc.model_flops(model.config) == want
    without = model_flops(model.config, int(lens.sum()), int((lens * lens).sum()), vision_grid_thw=grids)
    assert want > without
    with pytest.raises(ValueError, match="omni model"):
        FlopsAccumulator().add_audio([10])


@pytest.mark.parametrize("model_type", ["qwen2_audio", "voxtral", "cosmos3_omni", "whisper"])
def test_other_audio_models_are_refused_by_name(model_type):
    with pytest.raises(ValueError, match=rf"model_type '{model_type}' has audio inputs, which thdpack packs only for "
                                         r"the Qwen-Omni thinkers \(qwen2_5_omni"):
        get_family({"model_type": model_type})


@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.sampled_from([3, 7, 8, 9, 15, 16, 17, 23, 24, 25, 40]), min_size=0, max_size=3),
                min_size=1, max_size=4), st.integers(0, 2**16))
def test_clip_lengths_around_the_chunk_size(clip_lengths, seed):
    """Qwen2.5-Omni (chunks of 8 frames): samples of 0-3 clips whose lengths sit on, below and above multiples of
    the chunk, packed together: every sample's logits and TMRoPE rows equal it alone."""
    model = _qwen2_5_sdpa()
    rng = np.random.default_rng(seed)
    samples = [make_sample(rng, [("text", 2)] + [("audio", n) for n in lengths] + [("text", 2)])
               for lengths in clip_lengths]
    batch = build_thd_batch(samples, vlm=get_family(model.config), pad_multiple=4)
    with torch.no_grad():
        out = model(**to_hf_kwargs(batch), use_cache=False)
        for i, sample in enumerate(samples):
            logits, _, _ = run_alone(model, sample)
            a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
            assert (out.logits[0, a: a + s] - logits).abs().max().item() < LOGIT_ATOL, f"sample {i}"
            assert torch.equal(batch.token_extras["mrope_position_ids"][:, a: a + s], reference_positions(model, sample))


@functools.lru_cache(maxsize=1)
def _qwen2_5_sdpa():
    return tiny_thinker()


def test_a_cp_shard_of_an_omni_pack_names_its_audio_rows():
    """A CP rank's shard keeps the towers' inputs whole (their embeddings are scattered into the global stream
    before the split, as for Qwen-VL) and says, for each of its audio tokens, which row of the audio tower's
    output it takes: the audio rows of the whole pack's embeddings at the shard's positions."""
    from thdpack import shard

    model = tiny_thinker()
    rng = np.random.default_rng(3)
    samples = [make_sample(rng, parts) for parts in MIXED]
    batch = build_thd_batch(samples, vlm=get_family(model.config), cp_size=2)
    with torch.no_grad():
        embeds = model.model.get_audio_features(batch.extras["input_features"],
                                                batch.extras["feature_attention_mask"]).last_hidden_state
    audio = batch.input_ids == AUDIO
    assert int(audio.sum()) == embeds.shape[0]  # the tower gives one row per audio token of the pack
    whole = torch.zeros(batch.input_ids.numel(), embeds.shape[1])
    whole[audio] = embeds
    for rank in range(2):
        part = shard(batch, cp_size=2, cp_rank=rank)
        local = part.input_ids == AUDIO
        rows = part.extras["audio_embed_index"]
        assert rows.numel() == int(local.sum())
        torch.testing.assert_close(embeds[rows], whole[part.shard.partition_indices][local], rtol=0, atol=0)
