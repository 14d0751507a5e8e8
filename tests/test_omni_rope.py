"""thdpack.vlm.omni.rope (TMRoPE of one omni sample) against the installed transformers' own
``get_rope_index`` of the Qwen2.5-Omni and Qwen3-Omni-MoE thinkers, called unbound on a small object
that carries what it reads (``config``, ``spatial_merge_size``, the two helper methods).

Samples are laid out as the processors lay them out: ``<vision_bos> placeholders <vision_eos>``,
``<audio_bos> placeholders <audio_eos>``, and for ``use_audio_in_video`` the processor's own
``replace_video_with_audio_token`` (called unbound too) between ``<vision_bos>`` and ``<vision_eos>``.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thdpack.common.samples import SampleError
from thdpack.vlm.omni.rope import OmniRopeConfig, audio_tokens, omni_positions

transformers = pytest.importorskip("transformers")
from transformers import Qwen2_5OmniThinkerConfig, Qwen3OmniMoeThinkerConfig  # noqa: E402
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as m25  # noqa: E402
from transformers.models.qwen2_5_omni import processing_qwen2_5_omni as p25  # noqa: E402
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m3  # noqa: E402
from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe as p3  # noqa: E402

VISION_START, VISION_END, AUDIO_END = 151652, 151653, 151648


def _thinker_config(variant: str, **kw):
    if variant == "qwen2_5_omni":
        return Qwen2_5OmniThinkerConfig(vision_start_token_id=VISION_START, **kw)
    return Qwen3OmniMoeThinkerConfig(vision_start_token_id=VISION_START, **kw)


class _Model:
    """What get_rope_index reads of the model: ``config`` and ``spatial_merge_size``."""

    def __init__(self, config):
        self.config = config
        self.spatial_merge_size = config.vision_config.spatial_merge_size


class _Model25(_Model):
    get_rope_index = m25.Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index
    get_llm_pos_ids_for_vision = m25.Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_llm_pos_ids_for_vision
    get_chunked_index = m25.Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_chunked_index


class _Model3(_Model):
    get_rope_index = m3.Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_rope_index
    get_llm_pos_ids_for_vision = m3.Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_llm_pos_ids_for_vision


class _Processor:
    """What the processors' ``replace_video_with_audio_token`` reads; tokens are one character each."""

    audio_bos_token, audio_eos_token, video_token, audio_token = "B", "E", "v", "a"

    def __init__(self, merge, processor_cls):
        self.video_processor = type("VP", (), {"merge_size": merge})()
        self._cls = processor_cls

    def get_chunked_index(self, token_indices, tokens_per_chunk):
        return self._cls.get_chunked_index(self, token_indices, tokens_per_chunk)

    def audio_in_video(self, grid, seconds, n_audio, **kwargs) -> str:
        video = {"video_grid_thw": [np.array(grid)], "video_second_per_grid": [seconds]}
        return self._cls.replace_video_with_audio_token(self, video, 0, {"num_audio_tokens": [n_audio]}, 0, **kwargs)


def _reference_length(variant, config, lengths):
    t = torch.tensor(lengths, dtype=torch.long)
    if variant == "qwen2_5_omni":
        return m25.Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(None, t)[1].numpy()
    return m3._get_feat_extract_output_lengths(t, config.audio_config.n_window).numpy()


class Case:
    """A sample built item by item, with the inputs both implementations take."""

    def __init__(self, variant, config=None, seed=0):
        self.variant = variant
        self.config = config if config is not None else _thinker_config(variant)
        self.cfg = OmniRopeConfig.from_config(self.config)
        self.rng = np.random.default_rng(seed)
        self.ids, self.images, self.videos, self.seconds, self.lengths = [], [], [], [], []

    def text(self, n):
        self.ids += self.rng.integers(0, 1000, n).tolist()
        return self

    def image(self, grid):
        n = int(np.prod(grid)) // self.cfg.spatial_merge_size ** 2
        self.ids += [VISION_START] + [self.cfg.image_token_id] * n + [VISION_END]
        self.images.append(list(grid))
        return self

    def video(self, grid, seconds):
        n = int(np.prod(grid)) // self.cfg.spatial_merge_size ** 2
        self.ids += [VISION_START] + [self.cfg.video_token_id] * n + [VISION_END]
        self.videos.append(list(grid))
        self.seconds.append(seconds)
        return self

    def audio_len(self, length) -> int:
        """LLM tokens of a clip by the model's own rule (not the module's, which is under test)."""
        return int(_reference_length(self.variant, self.config, [length])[0])

    def audio(self, length):
        n = self.audio_len(length)
        self.ids += [self.cfg.audio_start_token_id] + [self.cfg.audio_token_id] * n + [AUDIO_END]
        self.lengths.append(length)
        return self

    def audio_in_video(self, grid, seconds, length):
        cfg = self.cfg
        n = self.audio_len(length)
        kwargs = {"position_id_per_seconds": cfg.position_id_per_seconds}
        if self.variant == "qwen2_5_omni":
            kwargs["seconds_per_chunk"] = cfg.seconds_per_chunk
            proc = _Processor(cfg.spatial_merge_size, p25.Qwen2_5OmniProcessor)
        else:
            proc = _Processor(cfg.spatial_merge_size, p3.Qwen3OmniMoeProcessor)
        chars = {"B": cfg.audio_start_token_id, "E": AUDIO_END, "v": cfg.video_token_id, "a": cfg.audio_token_id}
        layout = proc.audio_in_video(grid, seconds, n, **kwargs)
        self.ids += [VISION_START] + [chars[c] for c in layout] + [VISION_END]
        self.videos.append(list(grid))
        self.seconds.append(seconds)
        self.lengths.append(length)
        return self

    def inputs(self):
        def tensor(x, dtype):
            return torch.tensor(x, dtype=dtype) if x else None
        return (tensor(self.images, torch.long), tensor(self.videos, torch.long),
                tensor(self.seconds, torch.float64), tensor(self.lengths, torch.long))

    def reference(self, use_audio_in_video=False) -> np.ndarray:
        images, videos, seconds, lengths = self.inputs()
        model = (_Model25 if self.variant == "qwen2_5_omni" else _Model3)(self.config)
        ids = torch.tensor([self.ids], dtype=torch.long)
        positions, _ = model.get_rope_index(ids, images, videos, torch.ones_like(ids), use_audio_in_video,
                                            lengths, seconds)
        return positions[:, 0, :].numpy()

    def ours(self, use_audio_in_video=False) -> np.ndarray:
        images, videos, seconds, lengths = self.inputs()
        return omni_positions(self.cfg, np.array(self.ids, dtype=np.int64), image_grid_thw=images,
                              video_grid_thw=videos, second_per_grid=seconds, audio_feature_lengths=lengths,
                              use_audio_in_video=use_audio_in_video)

    def check(self, use_audio_in_video=False):
        want, got = self.reference(use_audio_in_video), self.ours(use_audio_in_video)
        assert got.dtype == want.dtype == self.cfg.position_dtype
        assert got.shape == want.shape == (3, len(self.ids))
        np.testing.assert_array_equal(got, want)
        return got


VARIANTS = ["qwen2_5_omni", "qwen3_omni_moe"]


# ---- config and audio length rule ------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_config_from_object_and_dict(variant):
    config = _thinker_config(variant)
    cfg = OmniRopeConfig.from_config(config)
    assert cfg == OmniRopeConfig.from_config(config.to_dict())
    whole = {"model_type": variant, "thinker_config": config.to_dict()}  # the whole omni model's config
    assert cfg == OmniRopeConfig.from_config(whole)
    with pytest.raises(ValueError, match="not an omni thinker"):
        OmniRopeConfig.from_config({"model_type": "qwen2_vl"})
    assert cfg.variant == variant
    assert (cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id) == (
        config.image_token_id, config.video_token_id, config.audio_token_id)
    assert cfg.vision_start_token_id == VISION_START and cfg.audio_start_token_id == config.audio_start_token_id
    assert cfg.position_id_per_seconds == config.position_id_per_seconds
    if variant == "qwen2_5_omni":
        assert cfg.seconds_per_chunk == config.seconds_per_chunk and cfg.n_window is None
    else:
        assert cfg.n_window == config.audio_config.n_window and cfg.seconds_per_chunk is None


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n_window", [50, 7, 100])
def test_audio_tokens_follow_the_model_rule(variant, n_window):
    config = _thinker_config(variant, audio_config={"n_window": n_window})
    lengths = np.arange(0, 1500)
    want = _reference_length(variant, config, lengths)
    np.testing.assert_array_equal(audio_tokens(OmniRopeConfig.from_config(config), lengths), want)


# ---- fixed cases -----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_text_only_and_audio_without_grids(variant):
    Case(variant).text(9).check()
    Case(variant).text(3).audio(180).text(4).audio(33).check()


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_image(variant):
    Case(variant).text(5).image([1, 4, 6]).text(3).check()
    Case(variant).image([1, 8, 2]).check()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seconds", [0.5, 1.0, 2.0, 1 / 3, 0.08333333])
def test_one_video(variant, seconds):
    Case(variant).text(2).video([3, 4, 4], seconds).text(4).check()


@pytest.mark.parametrize("variant", VARIANTS)
def test_audio_image_text_mixes(variant):
    Case(variant).text(3).audio(150).text(2).image([1, 4, 4]).text(1).check()
    Case(variant).image([2, 2, 4]).audio(99).audio(101).text(5).check()
    Case(variant).text(1).video([2, 4, 2], 0.5).audio(40).image([1, 2, 2]).check()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seconds", [0.5, 1.0, 2.0, 4.0, 0.3])
def test_audio_in_video(variant, seconds):
    Case(variant).text(4).audio_in_video([4, 4, 4], seconds, 300).text(3).check(True)
    # a short clip beside a large frame: the video's tail sets the next start
    Case(variant).audio_in_video([3, 8, 8], seconds, 20).check(True)
    # with an image and a plain audio clip around it
    Case(variant).image([1, 4, 4]).text(2).audio_in_video([2, 4, 4], seconds, 101).audio(77).text(1).check(True)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seconds", [0.04, 0.12, 0.44, 0.7, 0.36, 2 / 30])
def test_float32_time_arithmetic(variant, seconds):
    """Seconds where torch's float32 ``i · s · pps`` (truncated, or kept) differs from float64's."""
    Case(variant).text(1).video([8, 2, 2], seconds).text(1).check()
    Case(variant).audio_in_video([8, 2, 2], seconds, 190).check(True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_audio_tail_after_a_wide_frame(variant):
    """The audio outlasts the video, whose width is larger than the audio's last position: the model
    starts the eos one past the last piece (the audio), not past the block's largest value."""
    Case(variant).audio_in_video([1, 8, 8], 1.0, 20).text(2).check(True)
    Case(variant).text(3).audio_in_video([1, 12, 12], 0.5, 25).image([1, 2, 2]).check(True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_several_clips_and_videos(variant):
    case = Case(variant).text(2)
    for k in range(3):
        case.audio_in_video([2 + k, 2, 4], [0.5, 1.0, 2.0][k], 100 * k + 99).text(1)
    case.check(True)


# ---- random samples --------------------------------------------------------------------------------
def _lengths(variant):
    if variant == "qwen2_5_omni":
        return st.integers(3, 220)  # 1 or 2 frames give no token: get_rope_index fails (tested below)
    return st.one_of(st.integers(1, 350),
                     st.builds(lambda k, d: max(1, 100 * k + d), st.integers(0, 4), st.integers(-1, 1)))


_GRIDS = st.tuples(st.integers(1, 4), st.sampled_from([2, 4, 6]), st.sampled_from([2, 4, 6]))
_SECONDS = st.sampled_from([0.5, 1.0, 2.0, 4.0, 1 / 3, 0.7, 0.08333333, 1.5, 0.04, 0.12, 0.44])


def _items(variant):
    item = st.one_of(
        st.tuples(st.just("text"), st.integers(1, 5)),
        st.tuples(st.just("image"), _GRIDS),
        st.tuples(st.just("video"), _GRIDS, _SECONDS),
        st.tuples(st.just("audio"), _lengths(variant)),
        st.tuples(st.just("audio_in_video"), _GRIDS, _SECONDS, _lengths(variant)),
    )
    return st.lists(item, min_size=1, max_size=6)


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(variant=st.sampled_from(VARIANTS), items=st.data(), seed=st.integers(0, 2 ** 16))
def test_random_samples_match_get_rope_index(variant, items, seed):
    use_audio_in_video = items.draw(st.booleans())
    case = Case(variant, seed=seed)
    for kind, *args in items.draw(_items(variant)):
        if kind == "audio_in_video" and not use_audio_in_video:
            kind, args = "video", args[:2]
        if kind == "video" and use_audio_in_video:
            continue  # under use_audio_in_video every video carries its audio
        getattr(case, kind)(*args)
    if case.ids:
        case.check(use_audio_in_video)


# ---- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_errors_name_the_sample(variant):
    case = Case(variant).text(2).image([1, 4, 4]).text(1)
    ids = np.array(case.ids)
    with pytest.raises(SampleError, match="sample 7: the placeholder run"):
        omni_positions(case.cfg, ids, image_grid_thw=[[1, 4, 6]], sample=7)
    with pytest.raises(SampleError, match="more image placeholder runs than image_grid_thw rows"):
        omni_positions(case.cfg, np.concatenate([ids, ids]), image_grid_thw=[[1, 4, 4]])
    with pytest.raises(SampleError, match="2 image items given, 1 placeholder runs found"):
        omni_positions(case.cfg, ids, image_grid_thw=[[1, 4, 4], [1, 4, 4]])
    audio = Case(variant).image([1, 2, 2]).audio(120)
    with pytest.raises(SampleError, match="does not hold the"):
        omni_positions(audio.cfg, np.array(audio.ids), image_grid_thw=[[1, 2, 2]], audio_feature_lengths=[300])
    with pytest.raises(SampleError, match="more audio placeholder runs than audio_feature_lengths"):
        omni_positions(audio.cfg, np.array(audio.ids), image_grid_thw=[[1, 2, 2]])
    video = Case(variant).video([2, 2, 2], 1.0)
    with pytest.raises(SampleError, match="video 0 has no second_per_grid"):
        omni_positions(video.cfg, np.array(video.ids), video_grid_thw=[[2, 2, 2]])
    with pytest.raises(SampleError, match="image placeholder tokens but no image_grid_thw"):
        omni_positions(case.cfg, ids)


@pytest.mark.parametrize("variant", VARIANTS)
def test_audio_in_video_needs_the_flag(variant):
    case = Case(variant).audio_in_video([2, 4, 4], 1.0, 200)
    case.check(True)
    with pytest.raises(SampleError, match="sample 3"):
        images, videos, seconds, lengths = case.inputs()
        omni_positions(case.cfg, case.ids, video_grid_thw=videos, second_per_grid=seconds,
                       audio_feature_lengths=lengths, use_audio_in_video=False, sample=3)


def test_a_clip_without_tokens_is_refused():
    case = Case("qwen2_5_omni").image([1, 2, 2]).text(1)
    ids = case.ids + [case.cfg.audio_start_token_id, AUDIO_END]
    with pytest.raises(SampleError, match="sample 0: "):
        omni_positions(case.cfg, ids, image_grid_thw=[[1, 2, 2]], audio_feature_lengths=[2])
    ids = case.ids + [case.cfg.audio_start_token_id, case.cfg.audio_token_id, AUDIO_END]
    with pytest.raises(SampleError, match="audio clip 0 gives no LLM token"):
        omni_positions(case.cfg, ids, image_grid_thw=[[1, 2, 2]], audio_feature_lengths=[2])


@pytest.mark.parametrize("variant,kw", [
    ("qwen2_5_omni", {"position_id_per_seconds": 13, "seconds_per_chunk": 3,
                      "vision_config": {"spatial_merge_size": 1}}),
    ("qwen2_5_omni", {"position_id_per_seconds": 7, "seconds_per_chunk": 1}),
    ("qwen3_omni_moe", {"position_id_per_seconds": 13, "audio_config": {"n_window": 8},
                        "vision_config": {"spatial_merge_size": 1}}),
])
def test_other_constants(variant, kw):
    config = _thinker_config(variant, **kw)
    for seconds in (0.5, 1 / 3, 2.0):
        case = Case(variant, config=config).text(2).image([1, 4, 2])
        case.audio_in_video([3, 2, 4], seconds, 97).audio(41).check(True)
        Case(variant, config=config).text(1).audio_in_video([4, 2, 2], seconds, 130).audio(17).check(True)
        Case(variant, config=config).video([3, 2, 2], seconds).audio(50).image([1, 2, 2]).check(False)
