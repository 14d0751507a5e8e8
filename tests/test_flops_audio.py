"""thdpack.flops on the audio encoders of the Qwen-Omni thinkers (issue 48 point 3): tiny random-weight
Qwen2.5-Omni and Qwen3-Omni-MoE audio encoders (float32, CPU, eager attention) counted by
``torch.utils.flop_counter.FlopCounterMode`` equal the ``audio_*`` terms to the last FLOP, for one clip, several
clips and lengths around multiples of the chunk (``2·n_window`` frames); attention costs ``Σ chunk²``, not the
clip length squared.

FlopCounterMode counts ``aten.convolution`` (the stride convs, on every chunk padded to the call's longest),
``aten.addmm`` / ``aten.mm`` (the Linear layers; biases are not FLOPs to it) and, with eager attention,
``aten.bmm`` (``Q·Kᵀ`` and ``P·V`` per chunk). It counts nothing for SDPA's CPU kernel, so the tests run eager.
"""

from __future__ import annotations

import pytest
import torch

from thdpack.flops import AudioStats, audio_seqlen_stats, flops_coefficients, model_flops, model_flops_breakdown

transformers = pytest.importorskip("transformers")
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

Q25 = pytest.importorskip("transformers.models.qwen2_5_omni.modeling_qwen2_5_omni")
Q25C = pytest.importorskip("transformers.models.qwen2_5_omni.configuration_qwen2_5_omni")
Q3 = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
Q3C = pytest.importorskip("transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe")

TEXT = {"model_type": "qwen2_5_omni_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}
MEL, D, HEADS, FFN, LAYERS, OUT = 16, 32, 2, 48, 2, 24


def qwen2_5_audio(n_window: int = 4):
    return Q25C.Qwen2_5OmniAudioEncoderConfig(num_mel_bins=MEL, encoder_layers=LAYERS, encoder_attention_heads=HEADS,
                                              encoder_ffn_dim=FFN, d_model=D, n_window=n_window, output_dim=OUT,
                                              max_source_positions=64)


def qwen3_audio(n_window_infer: int = 200):
    # n_window 50: transformers' Qwen3-Omni writes the 13 tokens of a full 100-frame chunk as a constant
    return Q3C.Qwen3OmniMoeAudioEncoderConfig(num_mel_bins=MEL, encoder_layers=LAYERS, encoder_attention_heads=HEADS,
                                              encoder_ffn_dim=FFN, d_model=D, n_window=50,
                                              n_window_infer=n_window_infer, output_dim=OUT,
                                              downsample_hidden_size=8, max_source_positions=64, conv_chunksize=3)


_ENCODERS = {}


def encoder(audio_config):
    key = audio_config.to_json_string()
    if key not in _ENCODERS:
        cls = Q3.Qwen3OmniMoeAudioEncoder if "qwen3" in audio_config.model_type else Q25.Qwen2_5OmniAudioEncoder
        torch.manual_seed(0)
        _ENCODERS[key] = cls._from_config(audio_config, attn_implementation="eager").float().eval()
    return _ENCODERS[key]


def counted(audio_config, lengths, backward: bool = False) -> dict:
    """FlopCounterMode's FLOPs per aten op of the encoder on clips of ``lengths`` mel frames."""
    model = encoder(audio_config)
    lens = torch.tensor(lengths)
    features = torch.randn(MEL, int(lens.sum()))
    with FlopCounterMode(display=False) as counter:
        if backward:
            model.train()
            model(input_features=features, feature_lens=lens).last_hidden_state.sum().backward()
            model.eval()
        else:
            with torch.no_grad():
                model(input_features=features, feature_lens=lens)
    return {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}


def thinker(audio_config) -> dict:
    return {"model_type": "qwen2_5_omni_thinker", "text_config": TEXT, "audio_config": audio_config.to_dict()}


def audio_terms(audio_config, lengths, backward: bool = False) -> dict:
    terms = model_flops_breakdown(thinker(audio_config), 0, 0, audio_feature_lengths=lengths,
                                  audio_backward=backward)
    return {k: v for k, v in terms.items() if k.startswith("audio_")}


QWEN2_5_LENGTHS = [[1], [7], [8], [9], [16], [17], [63], [64], [65], [15, 16, 17], [3, 40, 23, 8], [100]]
QWEN3_LENGTHS = [[1], [99], [100], [101], [199, 200, 201], [450, 37], [401], [800]]


@pytest.mark.parametrize("lengths", QWEN2_5_LENGTHS)
def test_qwen2_5_omni_audio_encoder_forward_equals_flop_counter(lengths):
    audio = qwen2_5_audio()
    seen, terms = counted(audio, lengths), audio_terms(audio, lengths)
    assert seen["convolution"] == terms["audio_conv1"] + terms["audio_conv2"]
    assert seen["addmm"] + seen["mm"] == terms["audio_blocks"] + terms["audio_projection"]
    assert seen["bmm"] == terms["audio_attention"]
    assert sum(seen.values()) == sum(terms.values())


@pytest.mark.parametrize("lengths", QWEN3_LENGTHS)
def test_qwen3_omni_audio_encoder_forward_equals_flop_counter(lengths):
    audio = qwen3_audio()
    seen, terms = counted(audio, lengths), audio_terms(audio, lengths)
    assert seen["convolution"] == terms["audio_conv1"] + terms["audio_conv2"] + terms["audio_conv3"]
    assert seen["mm"] == terms["audio_conv_out"]  # the one Linear without a bias
    assert seen["addmm"] == terms["audio_blocks"] + terms["audio_projection"]
    assert seen["bmm"] == terms["audio_attention"]
    assert sum(seen.values()) == sum(terms.values())


def test_qwen3_attention_windows_follow_n_window_infer():
    # 450 frames: 4 chunks of 13 tokens + 7, windows of 13·(n_window_infer // 100) tokens
    for infer, square in ((100, 4 * 13**2 + 7**2), (200, 2 * 26**2 + 7**2), (800, 59**2)):
        audio = qwen3_audio(infer)
        stats = audio_seqlen_stats([450], audio)
        assert (stats.tokens, stats.seqlen_squared_sum) == (59, square)
        assert counted(audio, [450])["bmm"] == audio_terms(audio, [450])["audio_attention"]


def test_a_long_clip_costs_the_sum_of_its_chunks_squared_not_its_length_squared():
    """The same 64 frames in chunks of 8 and of 16 frames: 8 · 4² and 4 · 8² tokens², not 32²; FlopCounterMode
    sees the same."""
    small, large = qwen2_5_audio(4), qwen2_5_audio(8)
    a, b = audio_seqlen_stats([64], small), audio_seqlen_stats([64], large)
    assert (a.frames, a.tokens, a.seqlen_squared_sum) == (64, 32, 8 * 4**2)
    assert (b.frames, b.tokens, b.seqlen_squared_sum) == (64, 32, 4 * 8**2)
    seen_a, seen_b = counted(small, [64])["bmm"], counted(large, [64])["bmm"]
    assert seen_a == audio_terms(small, [64])["audio_attention"] == 4 * D * LAYERS * 128
    assert seen_b == audio_terms(large, [64])["audio_attention"] == 4 * D * LAYERS * 256
    assert seen_a < seen_b < 4 * D * LAYERS * 32**2


def test_stats_of_a_call_pad_its_chunks_to_the_longest():
    audio = qwen2_5_audio()  # chunks of 8 frames
    stats = audio_seqlen_stats(torch.tensor([3, 17], dtype=torch.int64), audio)
    assert stats == AudioStats(clips=2, frames=20, chunks=4, padded_frames=32, padded_frames_2=16, padded_frames_4=8,
                               padded_frames_8=4, tokens=2 + 4 + 4 + 1, seqlen_squared_sum=4 + 16 + 16 + 1,
                               output_tokens=1 + 4)
    assert audio_seqlen_stats([3], audio).padded_frames == 3  # alone, its chunk is the longest
    assert audio_seqlen_stats([3, 0, 17], audio) == stats
    assert audio_seqlen_stats([], audio) == AudioStats()
    assert stats + AudioStats() == stats


def test_training_count_and_the_backward_flop_counter():
    """``audio_backward=True`` is 3× the forward; FlopCounterMode's backward skips the input gradient of the first
    conv (the mel features need none), the one difference."""
    audio, lengths = qwen2_5_audio(), [15, 16, 17]
    seen, forward = counted(audio, lengths, backward=True), audio_terms(audio, lengths)
    training = audio_terms(audio, lengths, backward=True)
    assert training == {k: 3 * v for k, v in forward.items()}
    assert sum(seen.values()) == sum(training.values()) - forward["audio_conv1"]


def test_model_flops_reads_the_omni_config_and_counts_audio_only_when_given():
    audio = qwen2_5_audio()
    config = thinker(audio)
    omni = {"model_type": "qwen2_5_omni", "thinker_config": config}
    stats = audio_seqlen_stats([300, 45], omni)
    assert stats == audio_seqlen_stats([300, 45], config) == audio_seqlen_stats([300, 45], audio)
    base = model_flops(TEXT, 500, 90_000)
    assert model_flops(omni, 500, 90_000) == model_flops(config, 500, 90_000) == base
    with_audio = model_flops(omni, 500, 90_000, audio_feature_lengths=[300, 45])
    assert with_audio == model_flops(omni, 500, 90_000, audio_stats=stats) > base
    assert with_audio - base == sum(audio_terms(audio, [300, 45], backward=True).values())
    coefficients = flops_coefficients(config)
    assert coefficients.per("audio_seqlen_squared_sum") == 2 * 6 * D * LAYERS
    assert "audio_attention" not in flops_coefficients(config, include_audio=False).terms
    with pytest.raises(ValueError, match="no Qwen-Omni audio encoder"):
        model_flops(TEXT, 500, 90_000, audio_feature_lengths=[300])
    with pytest.raises(ValueError, match="not both"):
        model_flops(config, 500, 90_000, audio_feature_lengths=[300], audio_stats=stats)
    with pytest.raises(ValueError, match=r"audio_feature_lengths\[1\]"):
        audio_seqlen_stats([300, -1], config)
    with pytest.raises(ValueError, match=r"audio_feature_lengths\[0\]"):
        audio_seqlen_stats([2.5], config)
