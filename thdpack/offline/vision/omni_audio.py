"""Rows with audio in offline omni builds (a ``qwen2_5_omni_thinker`` / ``qwen3_omni_moe_thinker`` model_config,
or the whole omni model's): :func:`audio_build` (the set-up, :class:`AudioBuild`) and :class:`OmniRowTokenizer`,
the VLM row tokenizer (:mod:`thdpack.offline.vision.vlm_rows`) with each row's clips
(:mod:`thdpack.offline.vision.audio_clips`) and ``<audio>`` markers::

    {"messages": [{"role": "user", "content": "<audio>What is this sound?"},
                  {"role": "assistant", "content": "A tone."}],
     "audios": ["wav/a.wav"]}

Each marker becomes ``<audio_bos>`` + n × ``<audio>`` token + ``<audio_eos>`` (the model's ids), n by the model's
length rule (:func:`thdpack.vlm.omni.rope.audio_tokens`), never targets; markers not matching the clips, and
every clip fault, fail the row (a counted skip under ``skip_bad_rows``). The rows get ``input_features`` /
``audio_frames`` columns (:mod:`thdpack.offline.store.audio_columns`). Planning counts the audio tokens in the
row's length; a row with audio is never truncated or split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thdpack.common.align import check_int
from thdpack.common.samples import IGNORE_INDEX
from thdpack.offline.errors import ConfigError
from thdpack.offline.tokenizing.row_tokenizer import row_error
from thdpack.offline.vision.audio_clips import AUDIO_PLACEHOLDER, load_feature_extractor, max_seconds, row_audios
from thdpack.offline.vision.vlm_rows import VlmRowTokenizer, _append_lists, _count_markers, _ref_list, _substitute, _take

OMNI_TYPES = ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "qwen2_5_omni", "qwen3_omni_moe")


@dataclass
class AudioBuild:
    """The audio part of an omni build."""

    fe: object  # transformers.WhisperFeatureExtractor
    field: str
    placeholder: str
    limit_seconds: float
    rope: object  # thdpack.vlm.omni.rope.OmniRopeConfig
    audio_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int
    mel: int
    budget: int | None = None  # audio_budget: most audio feature frames in a pack (None: unbounded)

    def features(self) -> dict:
        import datasets

        return {"input_features": datasets.LargeList(datasets.Value("float32")),
                "audio_frames": datasets.List(datasets.Value("int32"))}

    def tokens(self, frames: np.ndarray) -> np.ndarray:
        """int64 ``[k]`` audio tokens of clips of ``frames`` feature frames (the model's rule)."""
        from thdpack.vlm.omni.rope import audio_tokens

        return audio_tokens(self.rope, np.asarray(frames, np.int64))


def audio_build(opts, model_config: dict, family) -> AudioBuild | None:
    """The :class:`AudioBuild` of the vision options ``opts`` for an omni ``model_config``; None for another
    family, or an omni one without ``audio_processor`` (rows with an audios field then fail the set-up)."""
    if family.model_type not in OMNI_TYPES:
        if opts.audio_processor is not None or opts.audio_budget is not None:
            raise ConfigError(f"audio_processor / audio_budget need an omni model_config (model_type one of {', '.join(OMNI_TYPES)})"
                              f", got {family.model_type!r}")
        return None
    if opts.audio_processor is None:
        if opts.audio_budget is not None:
            raise ConfigError("audio_budget needs audio_processor (an omni build of rows with audio)")
        return None
    from thdpack.common.model_config import config_get

    fe = load_feature_extractor(opts.resolve_path(opts.audio_processor), opts.audio_processor)
    thinker = model_config.get("thinker_config", model_config) if not family.model_type.endswith("_thinker") else model_config
    mel = config_get(thinker, "audio_config.num_mel_bins", None)
    if mel is not None and int(mel) != int(fe.feature_size):
        raise ConfigError(f"audio_processor's feature_size={fe.feature_size} but model_config's "
                          f"audio_config.num_mel_bins={mel}: the features would not fit the audio tower")
    rope = family.rope
    return AudioBuild(fe=fe, field=opts.audios_field or "audios", placeholder=opts.audio_placeholder or AUDIO_PLACEHOLDER,
                      limit_seconds=max_seconds(fe, opts.max_audio_seconds), rope=rope,
                      audio_token_id=rope.audio_token_id, audio_start_token_id=rope.audio_start_token_id,
                      audio_end_token_id=int(config_get(thinker, "audio_end_token_id", rope.audio_start_token_id + 1)),
                      mel=int(fe.feature_size), budget=opts.audio_budget)


def audio_plan_checks(plan, tokenized, usable: np.ndarray, bad: list, budget: int | None = None):
    """``(bad, frames)``: ``bad`` and the usable rows with audio that break a rule of planning (a row with
    audio is never cut: its markers must match its clips): more feature frames than ``budget``
    (``audio_budget``; not under ``overflow: drop``, which drops them), or too long for a pack under
    ``overflow: truncate / split``; ``frames``: int64 ``[rows]`` audio feature frames of every row."""
    from thdpack.offline.store.audio_columns import row_audio_frames

    frames, clips = row_audio_frames(tokenized.dataset.data.table)
    seen = {r for r, _ in bad}
    if budget is not None and plan.overflow != "drop":
        for r in np.flatnonzero(usable & (frames > budget)).tolist():
            if r not in seen:
                seen.add(r)
                bad.append((r, f"{int(frames[r])} audio frames, more than audio_budget={budget} allows "
                               f"(overflow={plan.overflow}; use overflow: drop or a larger audio_budget)"))
    if plan.overflow not in ("truncate", "split"):
        return bad, frames
    for r in np.flatnonzero(usable & (clips > 0) & (np.asarray(tokenized.lengths) > plan.usable_length)).tolist():
        if r not in seen:
            bad.append((r, f"{int(tokenized.lengths[r])} tokens, more than pack_size={plan.pack_size} allows, with "
                           f"{int(clips[r])} audio clip(s): a row with audio cannot be {plan.overflow}; use overflow: "
                           "drop or a larger pack_size"))
    return bad, frames


class OmniRowTokenizer(VlmRowTokenizer):
    """:class:`VlmRowTokenizer` with each row's audio clips: markers expanded, features computed, audio
    tokens checked and kept out of the targets, ``input_features`` / ``audio_frames`` columns added."""

    def __init__(self, fmt, opts, tokenizer, columns, vlm, source, bpe=None):
        super().__init__(fmt, opts, tokenizer, columns, vlm, source, bpe)
        self.audio = vlm.audio
        vocab = len(tokenizer)
        strings = []
        for name in ("audio_start_token_id", "audio_token_id", "audio_end_token_id"):
            tid = getattr(self.audio, name)
            check_int(tid, f"model_config's {name}", 0, below=vocab, hint=" (a token id of the tokenizer)",
                      error=ConfigError)
            strings.append(tokenizer.convert_ids_to_tokens(int(tid)))
        self.audio_strs = strings

    def _media(self, table, values: list, errors: list):
        vision = super()._media(table, values, errors)  # images / videos; content parts flattened
        refs = self._refs(table, errors, self.audio.field)
        rows = table.column("__thdpack_row__").to_numpy()
        vision.audio = [None] * table.num_rows
        for i in range(table.num_rows):
            if errors[i] is None and vision.videos[i] is not None:  # not silently: their positions need both
                errors[i] = ("a video in an omni build: not supported yet (its video_second_per_grid and audio in "
                             "video are not stored, so its TMRoPE positions would be wrong); build its rows "
                             "without videos, or pack them online with build_thd_batch(vlm=get_family(...))")
            if errors[i] is not None:
                continue
            try:
                values[i], vision.audio[i] = self._row_audio(values[i], refs[i], int(rows[i]))
            except ValueError as exc:  # ours: the message names the clip
                errors[i] = str(exc)
            except Exception as exc:  # noqa: BLE001 - the decoder's or extractor's: a row error
                errors[i] = row_error(exc)
        return vision

    def _row_audio(self, value, refs, row: int):
        a = self.audio
        refs = _ref_list(refs, a.field, "audio")
        found = _count_markers(value, a.placeholder)
        if found != len(refs):
            raise ValueError(f"{found} '{a.placeholder}' marker(s) but {len(refs)} audio clip(s)")
        if not refs:
            return value, None
        clips = row_audios(refs, self._base_dir(row), a.fe, a.limit_seconds)
        bos, pad, eos = self.audio_strs
        runs = [bos + pad * int(n) + eos for n in a.tokens(clips.frames)]
        return _substitute(value, a.placeholder, runs), clips

    def _to_table(self, ids, targets, errors, vision):
        audio = getattr(vision, "audio", [None] * len(ids))
        for i in range(len(ids)):
            if errors[i] is None and ids[i] is not None:
                targets[i], errors[i] = self._audio_targets(ids[i], targets[i], audio[i])
        table = super()._to_table(ids, targets, errors, vision)
        ok = {i for i, e in enumerate(errors) if e is None}
        clips = _take(audio, ok)
        table = _append_lists(table, "audio_frames", [c and c.frames for c in clips])
        flat = [None if c is None else np.concatenate([x.reshape(-1) for x in c.clips()]) for c in clips]
        return _append_lists(table, "input_features", flat, True)

    def _audio_targets(self, ids: np.ndarray, targets: np.ndarray, clips):
        """``(targets, error)``: the row's audio tokens counted against its clips and out of the targets."""
        a = self.audio
        want = int(a.tokens(clips.frames).sum()) if clips is not None else 0
        got = int((ids == a.audio_token_id).sum())
        if got != want:
            return targets, (f"{got} audio tokens ({self.audio_strs[1]!r}) after tokenizing but the clips need {want}: "
                             "the text contains audio tokens itself, or the tokenizer does not keep the model's audio "
                             "token as one token")
        mask = np.isin(ids, [a.audio_token_id, a.audio_start_token_id, a.audio_end_token_id]) if want else None
        if mask is not None and mask.any():
            targets = np.where(mask, False, targets) if targets.dtype == bool else np.where(mask, IGNORE_INDEX, targets)
        return targets, None
