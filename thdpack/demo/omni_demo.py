"""The omni demo: a self-contained offline omni build (a Qwen2.5-Omni thinker's rows with audio), nothing downloaded.

:func:`write_omni_demo` writes, into one directory:

- ``wav/*.wav``: seeded sine tones (16 kHz mono int16, 0.3-2 s), written with the stdlib ``wave`` module;
- ``data.jsonl``: chat rows with ``<audio>`` markers and their ``audios`` (some rows without audio);
- ``tokenizer/``: the demo tokenizer with the thinker's vision and audio tokens added (ids 3072-3078);
- ``feature_extractor/``: ``transformers.WhisperFeatureExtractor(feature_size=MEL)``'s ``save_pretrained``;
- ``model/config.json``: a tiny ``qwen2_5_omni_thinker`` config (:func:`tiny_omni_thinker_config`);
- ``build.yaml``: the build config (``audio_processor``, ``audio_budget``), paths relative to it.

``python scripts/make_demo.py omni --output demo/omni`` then
``thdpack build --config demo/omni/build.yaml --output out/demo_omni`` (docs/vlm.md, "Offline omni builds").
"""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np

from thdpack.common.align import check_int

MEL = 16  # mel bins of the tiny thinker's audio tower (the feature extractor's feature_size)
SAMPLING_RATE = 16000
# the thinker's special tokens, added to the demo tokenizer in this order: ids 3072..3078
OMNI_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
               "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
FIRST_ADDED_ID = 3072
PACK_SIZE = 1024
AUDIO_BUDGET = 600  # feature frames per pack (100 a second)
_QUESTIONS = ("<audio>What is this sound?", "Listen: <audio> How long is it?", "Compare <audio> with <audio>.",
              "<audio> Is this tone high or low?")


def tiny_omni_thinker_config(vocab_size: int = FIRST_ADDED_ID + 8) -> dict:
    """A tiny ``qwen2_5_omni_thinker`` config dict (1-layer towers, 2-layer text model; the demo tokenizer's ids)."""
    from transformers import Qwen2_5OmniThinkerConfig

    vs, ve, img, vid, abos, aud, aeos = range(FIRST_ADDED_ID, FIRST_ADDED_ID + len(OMNI_TOKENS))
    cfg = Qwen2_5OmniThinkerConfig(
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=MEL,
                          n_window=4, output_dim=64, max_source_positions=1500),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0], window_size=16,
                           in_channels=3),
        text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        audio_token_id=aud, image_token_id=img, video_token_id=vid, vision_start_token_id=vs, vision_end_token_id=ve,
        audio_start_token_id=abos, audio_end_token_id=aeos, position_id_per_seconds=25, seconds_per_chunk=2)
    return cfg.to_dict()


def write_tone(path, seconds: float, freq: float, rate: int = SAMPLING_RATE) -> None:
    """A sine tone (mono int16 PCM, half scale) with the stdlib ``wave`` module."""
    t = np.arange(int(rate * seconds)) / rate
    x = (np.sin(2 * np.pi * freq * t) * 0.5 * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(x.tobytes())


def omni_rows(num_samples: int, seed: int, wav_dir: Path) -> list[dict]:
    """``num_samples`` seeded chat rows, three in four with 1-2 tones (written into ``wav_dir``)."""
    from thdpack.demo.synthetic import _Writer

    w = _Writer(seed)
    rows, clip = [], 0
    for _ in range(num_samples):
        if w.rng.random() < 0.25:
            rows.append({"messages": [{"role": "user", "content": w.prose(w.lognormal_words(20, 0.6, 120))},
                                      {"role": "assistant", "content": w.prose(w.lognormal_words(30, 0.6, 200))}]})
            continue
        question = _QUESTIONS[int(w.rng.integers(len(_QUESTIONS)))]
        audios = []
        for _ in range(question.count("<audio>")):
            seconds = round(float(w.rng.uniform(0.3, 2.0)), 2)
            write_tone(wav_dir / f"{clip}.wav", seconds, float(w.rng.uniform(110, 880)))
            audios.append(f"wav/{clip}.wav")
            clip += 1
        answer = w.prose(w.lognormal_words(25, 0.6, 150))
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": answer}], "audios": audios})
    return rows


BUILD_YAML = """\
# The omni demo (thdpack/demo/omni_demo.py): a tiny Qwen2.5-Omni thinker's chat rows with generated tones.
# Paths are relative to this file.
input: data.jsonl
format: chat
loss: assistant
tokenizer: tokenizer
model_config: model                    # model/config.json: a qwen2_5_omni_thinker config
audio_processor: feature_extractor     # its WhisperFeatureExtractor (preprocessor_config.json)
pack_size: {pack_size}
audio_budget: {audio_budget}           # at most this many audio feature frames in a pack
overflow: error
seed: 0
num_proc: 1
"""


def write_omni_demo(output, num_samples: int = 24, seed: int = 0) -> Path:
    """Write the omni demo into ``output`` (see the module docstring); returns the path of its ``build.yaml``."""
    import transformers

    from thdpack.demo import TOKENIZER_DIR
    from thdpack.demo.synthetic import write_jsonl

    check_int(num_samples, "num_samples", 1)
    out = Path(output)
    (out / "wav").mkdir(parents=True, exist_ok=True)
    write_jsonl(omni_rows(num_samples, seed, out / "wav"), out / "data.jsonl")
    tok = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    tok.add_tokens(list(OMNI_TOKENS), special_tokens=True)
    ids = tok.convert_tokens_to_ids(list(OMNI_TOKENS))
    if ids != list(range(FIRST_ADDED_ID, FIRST_ADDED_ID + len(OMNI_TOKENS))):
        raise RuntimeError(f"the demo tokenizer gave the omni tokens the ids {ids}")
    tok.save_pretrained(str(out / "tokenizer"))
    transformers.WhisperFeatureExtractor(feature_size=MEL, sampling_rate=SAMPLING_RATE).save_pretrained(
        str(out / "feature_extractor"))
    (out / "model").mkdir(exist_ok=True)
    (out / "model" / "config.json").write_text(json.dumps(tiny_omni_thinker_config(), indent=2) + "\n")
    path = out / "build.yaml"
    path.write_text(BUILD_YAML.format(pack_size=PACK_SIZE, audio_budget=AUDIO_BUDGET))
    return path
