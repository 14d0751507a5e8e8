"""Time-aligned multimodal rotary positions (TMRoPE) of one omni-model sample, in numpy.

The thinker of Qwen2.5-Omni and of Qwen3-Omni-MoE gives every token three position rows
(temporal, height, width), as its ``get_rope_index`` walks one sample. This module is that
walk, item by item in Python (items are few), each item's positions vectorised:

- text: ``p, p+1, …`` on the three rows;
- an image / video (``<vision_bos> placeholders <vision_eos>``): the rows of its LLM grid
  ``(t, h/merge, w/merge)`` from the running start, temporal rows ``trunc(i · second_per_grid ·
  position_id_per_seconds)`` for videos (``i · position_id_per_seconds`` for images);
- an audio clip (``<audio_bos> placeholders <audio_eos>``): one position per LLM audio token;
- a video with its audio (``use_audio_in_video``: ``<vision_bos><audio_bos> … <audio_eos><vision_eos>``):
  video and audio tokens interleaved by time (Qwen2.5-Omni: by chunks of ``seconds_per_chunk``;
  Qwen3-Omni: token by token), both on the same time axis.

Each piece starts one past the largest value of the piece before it (every row counted), as the
model's does. Qwen2.5-Omni's positions are int64; Qwen3-Omni's ``get_rope_index`` computes them in
float32 (a video's ``second_per_grid · position_id_per_seconds`` need not be whole), so they are
float32 here too, with torch's float32 arithmetic step by step (bit-exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thdpack.common.model_config import check_config, config_first, config_get, model_type_of
from thdpack.common.samples import SampleError

QWEN2_5_OMNI = "qwen2_5_omni"
QWEN3_OMNI_MOE = "qwen3_omni_moe"
VARIANTS = (QWEN2_5_OMNI, QWEN3_OMNI_MOE)
# model_type (the thinker's or the whole model's) -> variant
_MODEL_TYPES = {
    "qwen2_5_omni_thinker": QWEN2_5_OMNI, "qwen2_5_omni": QWEN2_5_OMNI,
    "qwen3_omni_moe_thinker": QWEN3_OMNI_MOE, "qwen3_omni_moe": QWEN3_OMNI_MOE,
}
# the thinker configs do not define it; hub configs carry it (transformers' Qwen-VL default)
_DEFAULT_VISION_START = 151652


@dataclass(frozen=True)
class OmniRopeConfig:
    """The constants an omni thinker's ``get_rope_index`` reads, from its config.

    ``variant``: ``"qwen2_5_omni"`` or ``"qwen3_omni_moe"``. ``seconds_per_chunk``: Qwen2.5-Omni's
    audio-in-video chunk length (None for Qwen3-Omni). ``n_window``: Qwen3-Omni's audio encoder
    window (its audio length rule; None for Qwen2.5-Omni).
    """

    variant: str
    image_token_id: int
    video_token_id: int
    audio_token_id: int
    vision_start_token_id: int
    audio_start_token_id: int
    spatial_merge_size: int
    position_id_per_seconds: float | int = 25
    seconds_per_chunk: float | int | None = None
    n_window: int | None = None

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"OmniRopeConfig: variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.spatial_merge_size < 1:
            raise ValueError(f"OmniRopeConfig: spatial_merge_size must be >= 1, got {self.spatial_merge_size}")
        if self.variant == QWEN3_OMNI_MOE and (self.n_window is None or self.n_window < 1):
            raise ValueError(f"OmniRopeConfig: qwen3_omni_moe needs n_window >= 1, got {self.n_window}")
        if self.variant == QWEN2_5_OMNI:
            if self.seconds_per_chunk is None or int(self.position_id_per_seconds * self.seconds_per_chunk) < 1:
                raise ValueError("OmniRopeConfig: qwen2_5_omni needs int(position_id_per_seconds * seconds_per_chunk)"
                                 f" >= 1, got {self.position_id_per_seconds} * {self.seconds_per_chunk}")

    @property
    def position_dtype(self) -> np.dtype:
        """int64 (Qwen2.5-Omni) or float32 (Qwen3-Omni), the dtype of :func:`omni_positions`."""
        return np.dtype(np.int64 if self.variant == QWEN2_5_OMNI else np.float32)

    @classmethod
    def from_config(cls, config) -> "OmniRopeConfig":
        """The constants of a transformers thinker config, a whole omni config (its ``thinker_config``
        is read), or either's ``to_dict()``."""
        check_config(config)
        model_type = model_type_of(config)
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"OmniRopeConfig: model_type {model_type!r} is not an omni thinker "
                             f"(one of {sorted(_MODEL_TYPES)})")
        variant = _MODEL_TYPES[model_type]
        if not model_type.endswith("_thinker"):
            config = config_get(config, "thinker_config")
        qwen2_5 = variant == QWEN2_5_OMNI
        return cls(
            variant=variant,
            image_token_id=int(config_first(config, ("image_token_id", "image_token_index"), 151655)),
            video_token_id=int(config_first(config, ("video_token_id", "video_token_index"), 151656)),
            audio_token_id=int(config_first(config, ("audio_token_id", "audio_token_index"), 151646)),
            vision_start_token_id=int(config_get(config, "vision_start_token_id", _DEFAULT_VISION_START)),
            audio_start_token_id=int(config_get(config, "audio_start_token_id", 151647)),
            spatial_merge_size=int(config_get(config, "vision_config.spatial_merge_size", 2)),
            position_id_per_seconds=config_get(config, "position_id_per_seconds", 25),
            seconds_per_chunk=config_get(config, "seconds_per_chunk", 2) if qwen2_5 else None,
            n_window=None if qwen2_5 else int(config_get(config, "audio_config.n_window", 50)),
        )


def audio_tokens(config: OmniRopeConfig, feature_lengths) -> np.ndarray:
    """int64 ``[a]`` LLM tokens of each audio clip of ``feature_lengths`` ``[a]`` feature frames.

    Qwen2.5-Omni: ``((L-1)//2 + 1 - 2)//2 + 1``. Qwen3-Omni: the encoder runs chunks of
    ``2·n_window`` frames, 13 tokens per whole chunk plus the rule of the remainder
    (its ``_get_feat_extract_output_lengths``).
    """
    lengths = np.atleast_1d(np.asarray(feature_lengths))
    if lengths.ndim != 1 or not (lengths.size == 0 or np.issubdtype(lengths.dtype, np.integer)):
        raise ValueError(f"audio_tokens: feature_lengths must be 1-D integers, got {lengths.dtype} {lengths.shape}")
    lengths = lengths.astype(np.int64)
    if (lengths < 0).any():
        raise ValueError(f"audio_tokens: negative feature length {int(lengths.min())}")
    if config.variant == QWEN2_5_OMNI:
        return ((lengths - 1) // 2 + 1 - 2) // 2 + 1
    chunk = 2 * config.n_window
    feat = (lengths % chunk - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (lengths // chunk) * 13


@dataclass
class _Sample:
    """One sample's inputs, checked, and the walk's counters."""

    cfg: OmniRopeConfig
    ids: np.ndarray          # int64 [s]
    grids: dict              # "image" / "video" -> int64 [k, 3]
    spg: np.ndarray | None   # float32 [v] second_per_grid
    audio: np.ndarray | None  # int64 [a] LLM tokens per clip
    sample: int
    used: dict               # "image" / "video" / "audio" -> items consumed
    placed: dict             # placeholder token id -> tokens inside the items found

    def fail(self, detail: str, field: str | None = None) -> SampleError:
        return SampleError.at(self.sample, f": {detail}", field=field)

    def find(self, token: int, start: int, what: str) -> int:
        """Index of the first ``token`` at or after ``start`` (``list.index``)."""
        hits = np.flatnonzero(self.ids[start:] == token)
        if hits.size == 0:
            raise self.fail(f"no {what} token ({token}) after position {start}, where get_rope_index looks for one")
        return start + int(hits[0])

    def token(self, at: int) -> int:
        if at >= self.ids.size:
            raise self.fail(f"the sample ends inside a multimodal item (position {at})", "input_ids")
        return int(self.ids[at])

    def grid(self, kind: str) -> np.ndarray:
        """The next ``[3]`` grid of ``kind``; counts it as used."""
        grids, k = self.grids.get(kind), self.used[kind]
        if grids is None or k >= len(grids):
            have = 0 if grids is None else len(grids)
            raise self.fail(f"more {kind} placeholder runs than {kind}_grid_thw rows ({have})", f"{kind}_grid_thw")
        merge = self.cfg.spatial_merge_size
        if grids[k, 1] % merge or grids[k, 2] % merge:
            raise self.fail(f"{kind} {k}'s grid {grids[k].tolist()} is not divisible by spatial_merge_size {merge}",
                            f"{kind}_grid_thw")
        self.used[kind] += 1
        return grids[k]

    def clip(self) -> int:
        """LLM tokens of the next audio clip; counts it as used."""
        k = self.used["audio"]
        if self.audio is None or k >= len(self.audio):
            have = 0 if self.audio is None else len(self.audio)
            raise self.fail(f"more audio placeholder runs than audio_feature_lengths ({have})", "audio_feature_lengths")
        if self.audio[k] < 1:  # Qwen2.5-Omni: clips under 3 frames (get_rope_index fails on them)
            raise self.fail(f"audio clip {k} gives no LLM token (too few feature frames)", "audio_feature_lengths")
        self.used["audio"] += 1
        return int(self.audio[k])

    def seconds(self, video: int) -> np.float32:
        if self.spg is None or video >= len(self.spg):
            raise self.fail(f"video {video} has no second_per_grid", "second_per_grid")
        return self.spg[video]

    def check_run(self, start: int, counts: dict) -> int:
        """Checks that ``ids[start:]`` opens with a run of exactly ``counts`` placeholders
        (token id -> count, any order); returns the run's length."""
        n = sum(counts.values())
        run = self.ids[start:start + n]
        tokens = set(counts)
        got = {t: int((run == t).sum()) for t in tokens}
        after = self.ids[start + n] if start + n < self.ids.size else None
        if run.size != n or got != counts or (after is not None and int(after) in tokens):
            names = {self.cfg.image_token_id: "image", self.cfg.video_token_id: "video",
                     self.cfg.audio_token_id: "audio"}
            want = ", ".join(f"{c} {names.get(t, t)}" for t, c in counts.items())
            raise self.fail(f"the placeholder run at position {start} does not hold the {want} tokens its "
                            "grid / audio length gives", "input_ids")
        for t, c in counts.items():
            self.placed[t] = self.placed.get(t, 0) + c
        return n


class _Pieces:
    """The position pieces get_rope_index concatenates; a piece starts at one past the previous one's max."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.parts: list[np.ndarray] = []

    def start(self):
        return self.parts[-1].max() + self.dtype.type(1) if self.parts else self.dtype.type(0)

    def line(self, n: int, start=None) -> None:
        """``n`` text-like positions from ``start`` (default: :meth:`start`) on all three rows."""
        first = self.start() if start is None else start
        row = np.arange(n, dtype=self.dtype) + self.dtype.type(first)
        self.parts.append(np.broadcast_to(row, (3, n)))


def _vision_rows(t_index: np.ndarray, grid: np.ndarray, merge: int, start) -> np.ndarray:
    """``[3, t·h·w]`` rows of a vision item (``get_llm_pos_ids_for_vision``), in ``t_index``'s dtype."""
    h, w = int(grid[1]) // merge, int(grid[2]) // merge
    t = t_index.size
    dtype = t_index.dtype
    rows = np.empty((3, t * h * w), dtype=dtype)
    rows[0] = np.repeat(t_index, h * w)
    rows[1] = np.tile(np.repeat(np.arange(h, dtype=dtype), w), t)
    rows[2] = np.tile(np.arange(w, dtype=dtype), t * h)
    return rows + dtype.type(start)


def _time_index(cfg: OmniRopeConfig, grid_t: int, seconds) -> np.ndarray:
    """Temporal positions of a vision item's ``grid_t`` grids, torch's arithmetic: images
    ``arange · 1 · pps``; videos ``arange · float32(second_per_grid) · pps`` in float32;
    Qwen2.5-Omni truncates to int64, Qwen3-Omni keeps float32."""
    pps = cfg.position_id_per_seconds
    if seconds is None and isinstance(pps, (int, np.integer)):
        t = np.arange(grid_t, dtype=np.int64) * np.int64(pps)
    else:
        t = np.arange(grid_t, dtype=np.float32)
        if seconds is not None:
            t = t * np.float32(seconds)
        t = t * np.float32(pps)
    if cfg.variant == QWEN2_5_OMNI:
        return t.astype(np.int64)  # .long(): toward zero
    return t.astype(np.float32)


def _chunks(values: np.ndarray, per_chunk: int) -> list[tuple[int, int]]:
    """Qwen2.5-Omni's ``get_chunked_index`` of non-decreasing ``values`` (already less the start):
    a new chunk begins at ``i`` when ``values[i] >= c · per_chunk``, ``c`` counting the chunks so
    far (one per token at most). With ``q = values // per_chunk`` the chunks closed by token ``i``
    number ``b_i = min(q_i, b_{i-1} + 1) = i + min(1, min_{j<=i}(q_j - j))``."""
    n = values.size
    if n == 0:
        return [(0, 0)]
    q = values.astype(np.int64) // per_chunk
    i = np.arange(n)
    b = i + np.minimum(1, np.minimum.accumulate(q - i))
    cuts = np.flatnonzero(np.diff(b, prepend=0) > 0).tolist()
    starts, ends = [0] + cuts, cuts + [n]
    return list(zip(starts, ends))


def _item_counts(s: _Sample, use_audio_in_video: bool) -> tuple[int, int, int]:
    """(images, videos, audios) as get_rope_index counts them from the tokens after vision starts."""
    cfg, ids = s.cfg, s.ids
    starts = np.flatnonzero(ids == cfg.vision_start_token_id) + 1
    following = ids[starts[starts < ids.size]]
    images = int((following == cfg.image_token_id).sum())
    video_mark = cfg.audio_start_token_id if use_audio_in_video else cfg.video_token_id
    videos = int((following == video_mark).sum())
    audios = int((ids == cfg.audio_start_token_id).sum())
    return images, videos, audios


def _qwen2_5_vision(s: _Sample, out: _Pieces, kind: str, at: int) -> int:
    """An image or video at ``at`` (its first placeholder): bos, rows, eos; the tokens it spans after bos."""
    video = s.used["video"] if kind == "video" else None
    grid = s.grid(kind)
    seconds = None if video is None else s.seconds(video)
    out.line(1)
    merge = s.cfg.spatial_merge_size
    out.parts.append(_vision_rows(_time_index(s.cfg, int(grid[0]), seconds), grid, merge, out.start()))
    out.line(1)
    token = s.cfg.image_token_id if kind == "image" else s.cfg.video_token_id
    return s.check_run(at, {token: int(grid.prod()) // merge ** 2}) + 1


def _qwen2_5_audio_in_video(s: _Sample, out: _Pieces, at: int) -> int:
    """A video with its audio at ``at`` (its first placeholder): two bos at one position, the video's
    and the audio's chunks alternating, two eos at one position; the tokens spanned after the bos."""
    cfg, merge = s.cfg, s.cfg.spatial_merge_size
    video = s.used["video"]
    grid, seconds = s.grid("video"), s.seconds(video)
    bos = out.start()
    out.line(1, bos)
    out.line(1, bos)
    start = out.start()
    n_audio = s.clip()
    audio_rows = np.broadcast_to(np.arange(n_audio, dtype=np.int64) + start, (3, n_audio))
    video_rows = _vision_rows(_time_index(cfg, int(grid[0]), seconds), grid, merge, start)
    per_chunk = int(cfg.position_id_per_seconds * cfg.seconds_per_chunk)
    video_chunks = _chunks(video_rows[0] - start, per_chunk)
    audio_chunks = _chunks(audio_rows[0] - start, per_chunk)
    for j in range(max(len(video_chunks), len(audio_chunks))):
        for rows, chunks in ((video_rows, video_chunks), (audio_rows, audio_chunks)):
            if j < len(chunks):
                out.parts.append(rows[:, chunks[j][0]:chunks[j][1]])
    eos = out.start()
    out.line(1, eos)
    out.line(1, eos)
    n_video = int(grid.prod()) // merge ** 2
    return s.check_run(at, {cfg.video_token_id: n_video, cfg.audio_token_id: n_audio}) + 2


def _qwen2_5_walk(s: _Sample, use_audio_in_video: bool) -> np.ndarray:
    """Qwen2.5-Omni's get_rope_index for one sample (the branch with grids)."""
    cfg, n = s.cfg, s.ids.size
    images, videos, audios = _item_counts(s, use_audio_in_video)
    remain = {"image": images, "video": videos, "audio": audios}
    present = {k: bool((s.ids == t).any()) for k, t in
               (("image", cfg.image_token_id), ("video", cfg.video_token_id), ("audio", cfg.audio_token_id))}
    tokens = {"image": cfg.image_token_id, "video": cfg.video_token_id, "audio": cfg.audio_token_id}
    out, st = _Pieces(np.int64), 0
    for _ in range(images + audios if use_audio_in_video else images + videos + audios):
        ed = {k: s.find(tokens[k], st, k) if present[k] and remain[k] > 0 else n + 1 for k in tokens}
        min_ed = min(ed.values())
        kind = "audio" if min_ed == ed["audio"] else "image" if min_ed == ed["image"] else "video"
        if min_ed > n:
            raise s.fail("fewer placeholder runs than the vision / audio start tokens announce", "input_ids")
        in_video = kind == "video" and use_audio_in_video
        text = min_ed - st - (2 if in_video else 1)
        if text < 0:
            raise s.fail(f"the placeholder at position {min_ed} has no start token before it", "input_ids")
        if text:
            out.line(text)
        if kind == "audio":
            out.line(1)
            n_audio = s.clip()
            out.line(n_audio)
            out.line(1)
            span = s.check_run(min_ed, {cfg.audio_token_id: n_audio}) + 1
        elif in_video:
            span = _qwen2_5_audio_in_video(s, out, min_ed)
            remain["audio"] -= 1
        else:
            span = _qwen2_5_vision(s, out, kind, min_ed)
        remain[kind] -= 1
        st = min_ed + span
    if st < n:
        out.line(n - st)
    return _joined(s, out)


def _joined(s: _Sample, out: _Pieces) -> np.ndarray:
    """The pieces as one ``[3, s]`` array; checks every placeholder, grid and clip was used."""
    positions = np.concatenate(out.parts, axis=1) if out.parts else np.zeros((3, 0), out.dtype)
    if positions.shape[1] != s.ids.size:
        raise s.fail(f"the items span {positions.shape[1]} tokens, the sample has {s.ids.size}", "input_ids")
    for kind, have in (("image", s.grids.get("image")), ("video", s.grids.get("video")), ("audio", s.audio)):
        if have is not None and s.used[kind] != len(have):
            field = "audio_feature_lengths" if kind == "audio" else f"{kind}_grid_thw"
            raise s.fail(f"{len(have)} {kind} items given, {s.used[kind]} placeholder runs found", field)
    _check_placed(s)
    return np.ascontiguousarray(positions)


def _qwen3_interleave(s: _Sample, out: _Pieces, video_rows: np.ndarray, audio_rows: np.ndarray) -> None:
    """Qwen3-Omni's audio-in-video merge: token by token by temporal row, the video first on ties.

    Both rows are non-decreasing, so the merge is a stable sort of the two. The model appends the
    merged tokens one by one and the rest of the longer side as one piece; only that last piece's
    max sets the next start, so it is kept a piece of its own here."""
    merged = np.concatenate([video_rows, audio_rows], axis=1)
    order = np.argsort(merged[0], kind="stable")
    side = order >= video_rows.shape[1]  # True: audio
    if side.size == 0:
        return
    change = np.flatnonzero(side != side[-1])
    tail = int(change[-1]) + 1 if change.size else 0
    if tail:
        out.parts.append(merged[:, order[:tail]])
    out.parts.append(merged[:, order[tail:]])


def _qwen3_item(s: _Sample, out: _Pieces, kind: str, at: int, start) -> int:
    """The placeholders of one Qwen3-Omni item; ``at`` is its start token, ``start`` its first position.
    Returns the item's placeholder tokens."""
    cfg, merge = s.cfg, s.cfg.spatial_merge_size
    if kind == "audio":
        n_audio = s.clip()
        out.line(n_audio, start)
        return s.check_run(at + 1, {cfg.audio_token_id: n_audio})
    video = s.used["video"]
    grid = s.grid("image" if kind == "image" else "video")
    seconds = None if kind == "image" else s.seconds(video)
    rows = _vision_rows(_time_index(cfg, int(grid[0]), seconds), grid, merge, start)
    n_vision = int(grid.prod()) // merge ** 2
    if kind == "image":
        out.parts.append(rows)
        return s.check_run(at + 1, {cfg.image_token_id: n_vision})
    if kind == "video":
        out.parts.append(rows)
        return s.check_run(at + 1, {cfg.video_token_id: n_vision})
    n_audio = s.clip()
    audio = np.broadcast_to(np.arange(n_audio, dtype=np.float32) + start, (3, n_audio))
    _qwen3_interleave(s, out, rows, audio)
    return s.check_run(at + 2, {cfg.video_token_id: n_vision, cfg.audio_token_id: n_audio})


def _qwen3_walk(s: _Sample, use_audio_in_video: bool) -> np.ndarray:
    """Qwen3-Omni's get_rope_index for one sample (the branch with grids), in float32."""
    cfg, ids, n = s.cfg, s.ids, s.ids.size
    images, videos, audios = _item_counts(s, use_audio_in_video)
    remain = {"image": images, "video": videos, "audio": audios}
    has_vision = bool(((ids == cfg.image_token_id) | (ids == cfg.video_token_id)).any())
    has_audio = bool((ids == cfg.audio_token_id).any())
    out, st = _Pieces(np.float32), 0
    for _ in range(images + audios if use_audio_in_video else images + videos + audios):
        start = out.start()
        vs = (s.find(cfg.vision_start_token_id, st, "vision start")
              if has_vision and (remain["video"] > 0 or remain["image"] > 0) else n + 1)
        aus = s.find(cfg.audio_start_token_id, st, "audio start") if has_audio and remain["audio"] > 0 else n + 1
        min_ed = min(vs, aus)
        if min_ed > n:
            raise s.fail("fewer placeholder runs than the vision / audio start tokens announce", "input_ids")
        text = min_ed - st
        if text:
            out.line(text, start)
            start = start + np.float32(text)
        in_video = min_ed == vs and vs + 1 == aus
        ends = 2 if in_video else 1
        out.line(ends, start)
        start = start + np.float32(ends)
        if min_ed == aus:
            kind = "audio"
        else:
            after = s.token(vs + 1)
            kind = ("image" if after == cfg.image_token_id else "video" if after == cfg.video_token_id
                    else "audio_in_video" if in_video else None)
            if kind is None:
                raise s.fail(f"the vision start at position {vs} is followed by token {after}, "
                             "not an image / video placeholder or an audio start", "input_ids")
        placed = _qwen3_item(s, out, kind, min_ed, start)
        for k in (("video", "audio") if kind == "audio_in_video" else (kind,)):
            remain[k] -= 1
        st = min_ed + ends + placed + ends
        out.line(ends)
    if st < n:
        out.line(n - st)
    return _joined(s, out)


def _check_placed(s: _Sample) -> None:
    """Every placeholder token of the sample lies inside an item (none stray in the text)."""
    cfg = s.cfg
    for name, token in (("image", cfg.image_token_id), ("video", cfg.video_token_id), ("audio", cfg.audio_token_id)):
        total = int((s.ids == token).sum())
        if total != s.placed.get(token, 0):
            raise s.fail(f"{total - s.placed.get(token, 0)} {name} placeholder tokens lie outside the items "
                         "get_rope_index finds (a start token missing, or use_audio_in_video not as laid out)",
                         "input_ids")


def _grid_array(value, sample: int, field: str) -> np.ndarray | None:
    if value is None:
        return None
    grids = np.asarray(value.cpu() if hasattr(value, "cpu") else value)
    if grids.size == 0:
        grids = grids.reshape(0, 3)
    if grids.ndim != 2 or grids.shape[1] != 3 or not np.issubdtype(grids.dtype, np.integer):
        raise SampleError.at(sample, f": {field} must be integers of shape [k, 3], got {grids.dtype} {grids.shape}",
                             field=field)
    if (grids < 1).any():
        raise SampleError.at(sample, f": {field} has a grid size below 1: {grids.tolist()}", field=field)
    return grids.astype(np.int64)


def _sample_inputs(cfg, input_ids, image_grid_thw, video_grid_thw, second_per_grid, audio_feature_lengths,
                   sample: int) -> _Sample:
    ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise SampleError.at(sample, f": input_ids must be 1-D integers, got {ids.dtype} {ids.shape}",
                             field="input_ids")
    grids = {"image": _grid_array(image_grid_thw, sample, "image_grid_thw"),
             "video": _grid_array(video_grid_thw, sample, "video_grid_thw")}
    spg = None
    if second_per_grid is not None:
        spg = np.atleast_1d(np.asarray(second_per_grid.cpu() if hasattr(second_per_grid, "cpu") else second_per_grid,
                                       dtype=np.float64)).astype(np.float32)  # torch: .float()
        if spg.ndim != 1 or not np.isfinite(spg).all() or (spg < 0).any():
            raise SampleError.at(sample, f": second_per_grid must be finite seconds >= 0, got {spg.tolist()}",
                                 field="second_per_grid")
    audio = None
    if audio_feature_lengths is not None:
        lengths = audio_feature_lengths
        lengths = np.atleast_1d(np.asarray(lengths.cpu() if hasattr(lengths, "cpu") else lengths))
        if lengths.size and (not np.issubdtype(lengths.dtype, np.integer) or (lengths < 1).any()):
            raise SampleError.at(sample, f": audio_feature_lengths must be integers >= 1, got {lengths.tolist()}",
                                 field="audio_feature_lengths")
        audio = audio_tokens(cfg, lengths.astype(np.int64))
    return _Sample(cfg, ids.astype(np.int64), grids, spg, audio, sample,
                   {"image": 0, "video": 0, "audio": 0}, {})


def omni_positions(config: OmniRopeConfig, input_ids, *, image_grid_thw=None, video_grid_thw=None,
                   second_per_grid=None, audio_feature_lengths=None, use_audio_in_video: bool = False,
                   sample: int = 0) -> np.ndarray:
    """``[3, s]`` TMRoPE positions of one sample, equal to the thinker's ``get_rope_index`` for it alone.

    ``input_ids``: ``[s]`` (or ``[1, s]``) integers. ``image_grid_thw`` / ``video_grid_thw``: ``[k, 3]``
    integers of the sample's images / videos, in order. ``second_per_grid``: ``[v]`` seconds per temporal
    grid of each video (taken as float32, as torch's ``.float()``). ``audio_feature_lengths``: ``[a]``
    feature frames of each audio clip (videos' audio included, in order). ``use_audio_in_video``: each
    video is laid out with its audio (``<vision_bos><audio_bos> … <audio_eos><vision_eos>``).

    Returns int64 (Qwen2.5-Omni) or float32 (Qwen3-Omni) ``[3, s]``, ``config.position_dtype``.
    Without an image or video grid the model's positions are ``0..s-1`` on all rows (audio or not),
    and so are these. Raises :class:`SampleError` (naming ``sample``) when a placeholder run does not
    match its grid or audio length, or placeholder runs and grids / clips do not pair up.
    """
    s = _sample_inputs(config, input_ids, image_grid_thw, video_grid_thw, second_per_grid,
                       audio_feature_lengths, sample)
    if s.grids["image"] is None and s.grids["video"] is None:
        for name, token in (("image", config.image_token_id), ("video", config.video_token_id)):
            if (s.ids == token).any():
                raise s.fail(f"{name} placeholder tokens but no {name}_grid_thw", f"{name}_grid_thw")
        row = np.arange(s.ids.size).astype(config.position_dtype)
        return np.ascontiguousarray(np.broadcast_to(row, (3, s.ids.size)))
    if config.variant == QWEN2_5_OMNI:
        return _qwen2_5_walk(s, use_audio_in_video)
    return _qwen3_walk(s, use_audio_in_video)
