"""Counting what a training step consumes: :class:`FlopsAccumulator` adds up samples,
real and padded tokens, ``Σ sᵢ²``, the window and top-k counts the model needs, the
cross-attention counts and the vision counts, micro-batch by micro-batch, from
whatever the step holds (a :class:`thdpack.ThdBatch` or its CP shard, a dict of model
inputs, a tensor of token ids), and turns the totals into :func:`model_flops`.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Mapping

import torch

from thdpack.flops.coefficients import flops_coefficients
from thdpack.flops.model import model_flops
from thdpack.flops.sequences import (
    check_count,
    cp_length_count_share,
    cp_seqlen_squared_share,
    dense_square_sum,
    length_count,
    length_count_values,
    lengths_squared_sum,
    segment_lengths,
    segments_from_position_ids,
    seqlen_squared_sum,
    shows_no_tokens,
    tree_length_count,
)
from thdpack.flops.audio_stats import AudioStats, audio_config_of, audio_family, audio_seqlen_stats
from thdpack.flops.vision_stats import vision_config_of, vision_seqlen_stats, window_patches
from thdpack.common.model_config import check_config, config_get
from thdpack.parallel.shard import WHOLE, Shard

__all__ = ["FlopsAccumulator"]

_COUNTS = (
    "samples",
    "tokens",
    "padded_tokens",
    "seqlen_squared_sum",
    "vision_patches",
    "vision_seqlen_squared_sum",
    "vision_window_seqlen_squared_sum",
)


_CROSS_COUNTS = ("cross_tokens", "cross_seqlen_product_sum")
# an omni thinker's audio encoder: the AudioStats fields, counted per encoder call (one per batch)
_AUDIO_COUNTS = tuple(f"audio_{f.name}" for f in dataclasses.fields(AudioStats))


def _model_counts(config) -> tuple[str, ...]:
    """The counts beyond :data:`_COUNTS` the model of ``config`` needs (window and top-k counts, cross-attention
    counts), () when ``config`` is None or not a whole model config (a vision config): then
    :func:`model_flops` asks for them, naming each."""
    if config is None:
        return ()
    audio = _AUDIO_COUNTS if audio_family(audio_config_of(config)) is not None else ()
    try:
        coefficients = flops_coefficients(config, include_vision=False)
    except (KeyError, TypeError, ValueError, NotImplementedError, AttributeError):
        return audio
    return coefficients.length_counts + tuple(c for c in _CROSS_COUNTS if c in coefficients.counts) + audio


def _total(x):
    """A CPU tensor becomes a Python int; device tensors stay lazy (no host sync)."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return int(x)
    return x


class FlopsAccumulator:
    """Counts added micro-batch by micro-batch: samples, real tokens, padded tokens,
    ``Σ sᵢ²``, vision patches and the vision attention sums (:class:`VisionStats`).

    ``add`` takes a :class:`thdpack.ThdBatch` (a CP shard: its rank's share), a mapping of model inputs, or
    token ids ``[B, S]`` / ``[T]``: docs/flops.md, "FlopsAccumulator.add: what each input adds".

    Counts are Python ints; counts read from tensors on an accelerator are kept as
    device tensors until read (no host sync per micro-batch).

    Window, top-k and cross-attention counts (given the model config): docs/flops.md, "FlopsAccumulator:
    window, top-k and cross-attention counts".

    Args:
        vision_config: the model config (or its ``vision_config``); needed to sum
            Qwen2.5-VL attention windows from ``grid_thw``, and (a whole model config) for
            the window, top-k and cross-attention counts of the model.
    """

    def __init__(self, vision_config=None):
        if vision_config is not None:
            check_config(vision_config, "FlopsAccumulator's vision_config (the model config or its vision_config)")
        self._config_given = vision_config is not None
        self.vision_config = vision_config_of(vision_config)
        self.extra_counts = _model_counts(vision_config)
        self.audio_config = audio_config_of(vision_config) if vision_config is not None else None
        self.length_counts = tuple(c for c in self.extra_counts if c not in _CROSS_COUNTS + _AUDIO_COUNTS)
        self.reset()

    @property
    def count_names(self) -> tuple[str, ...]:
        """Every count this accumulator adds up: the base ones, then the model's window / top-k / cross ones."""
        return _COUNTS + self.extra_counts

    def reset(self) -> None:
        self._extra = {name: 0 for name in self.extra_counts}
        for name in _COUNTS:
            setattr(self, name, 0)

    def _get(self, name: str):
        return self._extra[name] if name in self._extra else getattr(self, name)

    def _add(self, **counts) -> None:
        for name, value in counts.items():
            if name in self._extra:
                self._extra[name] = self._extra[name] + _total(value)
            else:
                setattr(self, name, getattr(self, name) + _total(value))

    def _add_lengths(self, lengths: torch.Tensor) -> None:
        """The length counts of real ``lengths`` (int64, any shape; lazily on an accelerator)."""
        for name in self.length_counts:
            self._add(**{name: length_count_values(lengths, name).sum()})

    # ---- adders ----------------------------------------------------------
    def add(self, batch) -> "FlopsAccumulator":
        """Add one micro-batch (see the class docstring for what ``batch`` may be)."""
        if hasattr(batch, "cu_seqlens") and hasattr(batch, "seq_lens"):
            self._add_thd_batch(batch)
        elif isinstance(batch, Mapping):
            self._add_inputs(batch)
        elif isinstance(batch, torch.Tensor):
            if batch.ndim == 1:
                self.add_bshd(1, batch.shape[0])
            else:
                self.add_bshd(batch.shape[0], batch.shape[-1])
        else:
            raise TypeError(f"cannot count a batch of type {type(batch).__name__}")
        return self

    def _add_thd_batch(self, batch) -> None:
        seq_lens = batch.seq_lens.to(torch.int64)
        if getattr(batch, "prefix_tree", None) is not None:  # shared prefixes: the tree's work, its samples
            self._add(samples=batch.num_samples, tokens=seq_lens.sum(), padded_tokens=batch.input_ids.numel(),
                      seqlen_squared_sum=seqlen_squared_sum(batch))
            parents = batch.prefix_tree.parents
            self._add(**{name: tree_length_count(seq_lens, parents, name) for name in self.length_counts})
            return
        shard = getattr(batch, "shard", WHOLE)
        if shard.sp_size > 1:
            self._add_ulysses_shard(batch, shard, seq_lens)
            return
        if shard.cp_size > 1:
            cp, cp_rank, first = shard.cp_size, shard.cp_rank, shard.cp_rank == 0
            self._add(
                samples=(seq_lens > 0).sum() if first else 0,
                tokens=shard.local_seq_lens.to(torch.int64).sum(),
                padded_tokens=batch.input_ids.numel(),
                seqlen_squared_sum=cp_seqlen_squared_share(seq_lens, batch.cu_seqlens_padded, cp, cp_rank),
            )
            self._add(**{name: cp_length_count_share(seq_lens, batch.cu_seqlens_padded, cp, cp_rank, name)
                         for name in self.length_counts})
            if first:
                self._add_vision_from(batch.extras)
            return
        self._add(
            samples=(seq_lens > 0).sum(),
            tokens=seq_lens.sum(),
            padded_tokens=batch.input_ids.numel(),
            seqlen_squared_sum=(seq_lens * seq_lens).sum(),
        )
        self._add_lengths(seq_lens)
        self._add_vision_from(batch.extras)

    def _add_ulysses_shard(self, batch, shard: Shard, seq_lens: torch.Tensor) -> None:
        """A Ulysses SP rank (``thdpack.shard(batch, sp_size=, sp_rank=)``): the MLP work of its slice's real
        tokens, and ``1/sp`` of the attention work (its ``num_heads / sp`` heads over the whole stream, or over its CP
        rank's shard under Ulysses x ring); the ranks' shares add up to the pack's ``Σ sᵢ²`` exactly.
        The samples (and vision work) are counted by the first rank of the pack only."""
        sp, rank, cp, cp_rank = shard.sp_size, shard.sp_rank, shard.cp_size, shard.cp_rank
        cu = batch.cu_seqlens_padded.to(torch.int64).cpu()
        lens = seq_lens.cpu()
        whole = (cp_seqlen_squared_share(lens, cu, cp, cp_rank) if cp > 1 else (lens * lens).sum())
        whole = int(whole)
        positions = shard.partition_indices.to(torch.int64).cpu()
        sample = torch.searchsorted(cu[1:], positions, right=True).clamp(max=max(lens.numel() - 1, 0))
        real = (positions - cu[sample]) < lens[sample] if lens.numel() else torch.zeros(0, dtype=torch.bool)
        first = rank == 0 and cp_rank == 0
        self._add(
            samples=(lens > 0).sum() if first else 0,
            tokens=real.sum(),
            padded_tokens=batch.input_ids.numel(),
            seqlen_squared_sum=whole // sp + (rank < whole % sp),
        )
        for name in self.length_counts:  # each split over the SP ranks as Σ sᵢ² is
            count = int(cp_length_count_share(lens, cu, cp, cp_rank, name) if cp > 1 else length_count(lens, name))
            self._add(**{name: count // sp + (rank < count % sp)})
        if first:
            self._add_vision_from(batch.extras)

    def add_cu_seqlens(self, cu_seqlens=None, *, cu_seqlens_argmin=None, cu_seqlens_unpadded=None,
                       cu_seqlens_unpadded_argmin=None, num_padded_tokens=None,
                       cross_cu_seqlens=None, cross_cu_seqlens_unpadded=None) -> "FlopsAccumulator":
        """Add a packed micro-batch given by its cumulative lengths (arguments as
        :func:`seqlen_squared_sum`). Padded tokens: ``num_padded_tokens`` or the total
        of ``cu_seqlens`` (the padded layout when ``cu_seqlens_unpadded`` is given).

        Dense fallback: when the real lengths hold no tokens (``cu_seqlens=[0]``, or
        NeMo's ``[0, -1, -1]`` with argmin 1) but the micro-batch has ``T > 0`` tokens
        (``num_padded_tokens``, else the layout's total), it is counted as Megatron-LM and
        Megatron-Bridge count it: ``B`` sequences of ``T / B`` tokens, ``B`` the rows of
        ``cu_seqlens`` (1 for 1-D): ``B`` samples, ``T`` tokens, ``T² // B`` for ``Σ sᵢ²``.
        With neither ``num_padded_tokens`` nor a layout beside ``cu_seqlens_unpadded`` the
        token count is unknown, and such a micro-batch raises ``ValueError`` (on an
        accelerator only when :func:`shows_no_tokens` sees it: the check reads no device
        memory). ``num_padded_tokens=0`` adds an empty micro-batch: nothing.

        ``cross_cu_seqlens``: for cross-attention layers, the cumulative lengths of each sample's memory
        (the encoder's or image's tokens it attends to), one segment per sample of ``cu_seqlens``: adds
        ``cross_tokens = Σ kᵢ`` and ``cross_seqlen_product_sum = Σ sᵢ·kᵢ``. ``cross_cu_seqlens_unpadded``
        (the memories' real lengths, Megatron-Bridge's name) is preferred whenever given, as
        ``cu_seqlens_unpadded`` is for the queries. ``ValueError`` when the accumulator's config has no
        cross-attention layers (or it has no config): those counts would have no term to go to.
        """
        memory = self._cross_memory(cross_cu_seqlens, cross_cu_seqlens_unpadded)
        if cu_seqlens_unpadded is not None:
            name, cu, argmin = "cu_seqlens_unpadded", cu_seqlens_unpadded, cu_seqlens_unpadded_argmin
        else:
            name, cu, argmin = "cu_seqlens", cu_seqlens, cu_seqlens_argmin
        if cu is None:
            raise ValueError("pass cu_seqlens or cu_seqlens_unpadded")
        real = segment_lengths(cu, argmin, name=name)
        has_layout = cu_seqlens is not None and cu_seqlens_unpadded is not None
        layout = segment_lengths(cu_seqlens, cu_seqlens_argmin) if has_layout else real
        if num_padded_tokens is not None:
            check_count(num_padded_tokens, "num_padded_tokens")
        known = num_padded_tokens is not None or has_layout
        if num_padded_tokens is None:
            num_padded_tokens = layout.sum()
        rows = layout.shape[0]
        if memory is not None and memory.shape != real.shape:
            raise ValueError(f"cross_cu_seqlens holds {tuple(memory.shape)} memory lengths for {tuple(real.shape)} "
                             "samples: give one memory segment per sample of cu_seqlens")
        if real.device.type != "cpu":
            if not known and shows_no_tokens(cu, argmin):
                raise ValueError(_unknown_tokens_message(name))
            self._add(**_lazy_packed_counts(real, num_padded_tokens, rows, self.length_counts))
        else:
            self._add(**_packed_counts(real, _total(num_padded_tokens), rows, name if not known else None,
                                       self.length_counts))
        if memory is not None:
            memory = memory.to(real.device)
            self._add(cross_tokens=memory.sum(), cross_seqlen_product_sum=(real * memory).sum())
        return self

    def _cross_memory(self, cross_cu_seqlens, cross_cu_seqlens_unpadded) -> torch.Tensor | None:
        """The memory lengths (int64 ``[B, N]``) of the unpadded cumulative lengths when given, else of the
        padded ones; None when neither is. ``ValueError`` when this accumulator counts no cross-attention."""
        name, cu = "cross_cu_seqlens_unpadded", cross_cu_seqlens_unpadded
        if cu is None:
            name, cu = "cross_cu_seqlens", cross_cu_seqlens
        if cu is None:
            return None
        if "cross_tokens" not in self._extra:
            why = ("has no model config" if not self._config_given else "counts no cross-attention: its config "
                   "has no cross-attention layers (cross_attention_layers) or is not a whole model's")
            raise ValueError(f"{name} given, but this FlopsAccumulator {why}: build it with the config of the "
                             "model whose cross-attention layers read the memories, FlopsAccumulator(config)")
        return segment_lengths(cu, name=name)

    def add_bshd(self, micro_batch_size: int, seq_len: int) -> "FlopsAccumulator":
        """The legacy count of ``micro_batch_size`` sequences of ``seq_len`` tokens:
        ``B·S`` tokens and ``B·S²`` for ``Σ sᵢ²``. Both must be integers >= 0."""
        check_count(micro_batch_size, "micro_batch_size")
        check_count(seq_len, "seq_len")
        b, s = int(micro_batch_size), int(seq_len)
        self._add(samples=b, tokens=b * s, padded_tokens=b * s, seqlen_squared_sum=b * s * s)
        self._add(**{name: b * length_count([s], name) for name in self.length_counts})
        return self

    def add_vision(self, grid_thw) -> "FlopsAccumulator":
        """Add images / videos by their ``grid_thw`` rows (:func:`vision_seqlen_stats`)."""
        stats = vision_seqlen_stats(grid_thw, self.vision_config)
        self._add(
            vision_patches=stats.patches,
            vision_seqlen_squared_sum=stats.seqlen_squared_sum,
            vision_window_seqlen_squared_sum=stats.window_seqlen_squared_sum,
        )
        return self

    def add_audio(self, feature_lengths) -> "FlopsAccumulator":
        """Add one audio-encoder call over clips of ``feature_lengths`` (int ``[clips]`` mel frames;
        :func:`thdpack.flops.audio_stats.audio_seqlen_stats`); needs the omni model config."""
        if _AUDIO_COUNTS[0] not in self._extra:
            raise ValueError("add_audio needs FlopsAccumulator(model_config) of an omni model (Qwen2.5-Omni, Qwen3-Omni):"
                             " its audio encoder's chunking sets the counts")
        stats = audio_seqlen_stats(feature_lengths, self.audio_config)
        self._add(**{name: value for name, value in zip(_AUDIO_COUNTS, dataclasses.astuple(stats))})
        return self

    def _add_vision_from(self, mapping) -> None:
        for key in ("image_grid_thw", "video_grid_thw"):
            grid = mapping.get(key) if mapping is not None else None
            if grid is not None and len(grid):
                self.add_vision(grid)
        audio = mapping.get("audio_feature_lengths") if mapping is not None else None
        if audio is not None and len(audio) and _AUDIO_COUNTS[0] in self._extra:
            self.add_audio(audio)

    def _add_inputs(self, inputs: Mapping) -> None:
        ids = inputs.get("input_ids")
        padded = ids.numel() if isinstance(ids, torch.Tensor) else None
        cross = {key: inputs.get(key) for key in ("cross_cu_seqlens", "cross_cu_seqlens_unpadded")}
        if inputs.get("cu_seqlens_unpadded") is not None or inputs.get("cu_seqlens") is not None:
            self.add_cu_seqlens(
                inputs.get("cu_seqlens"),
                cu_seqlens_argmin=inputs.get("cu_seqlens_argmin"),
                cu_seqlens_unpadded=inputs.get("cu_seqlens_unpadded"),
                cu_seqlens_unpadded_argmin=inputs.get("cu_seqlens_unpadded_argmin"),
                num_padded_tokens=padded,
                **cross,
            )
        elif inputs.get("cu_seq_lens_q") is not None:
            self.add_cu_seqlens(inputs["cu_seq_lens_q"], num_padded_tokens=padded, **cross)
        elif isinstance(ids, torch.Tensor):
            pos = _restarting_positions(ids, inputs.get("position_ids"))
            if pos is not None:
                lengths = segments_from_position_ids(pos)
                self._add(samples=int(lengths.numel()), tokens=int(lengths.sum()), padded_tokens=padded,
                          seqlen_squared_sum=lengths_squared_sum(lengths))
                self._add(**{name: length_count(lengths, name) for name in self.length_counts})
            else:
                self.add(ids)
        else:
            raise ValueError("inputs hold none of cu_seqlens, cu_seq_lens_q, input_ids: nothing to count")
        self._add_vision_from(inputs)

    # ---- combining -------------------------------------------------------
    def counts(self) -> dict:
        """The counts as Python ints (host sync for device counts), by name: :data:`_COUNTS`, then the
        model's window / top-k / cross-attention counts (``"window_square_sum[4096]"``, ...)."""
        return {name: int(self._get(name)) for name in self.count_names}

    def merge(self, other: "FlopsAccumulator") -> "FlopsAccumulator":
        """Add ``other``'s counts into this accumulator (both must count the same model's counts)."""
        if not isinstance(other, FlopsAccumulator):
            raise TypeError(f"merge's other must be a FlopsAccumulator, got {type(other).__name__}")
        if other.count_names != self.count_names:
            raise ValueError(f"cannot merge an accumulator counting {list(other.count_names)} into one counting "
                             f"{list(self.count_names)}: build both with the same model config")
        self._add(**{name: other._get(name) for name in self.count_names})
        return self

    def all_reduce(self, group=None) -> "FlopsAccumulator":
        """Sum the counts over ``group`` (``torch.distributed``; a no-op when it is not
        initialized). Reduce over the ranks that see *different* data: data parallel
        × context parallel (CP shards hold shares, see the class docstring), not
        tensor / pipeline parallel ranks, which see the same micro-batches."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        names = self.count_names
        values = torch.stack([torch.as_tensor(self._get(n), dtype=torch.int64).to(device) for n in names])
        dist.all_reduce(values, group=group)
        self.reset()
        self._add(**dict(zip(names, values.tolist())))
        return self

    # ---- FLOPs -----------------------------------------------------------
    def model_flops(self, config, *, count_padding: bool = False, **options):
        """:func:`model_flops` of the counts so far; ``count_padding`` charges the linear
        terms for the padded tokens (the work done on pad slots) instead of the real ones."""
        window = self.vision_window_seqlen_squared_sum
        if self.vision_config is None and config_get(config, "vision_config", None) is not None:
            window = None if window_patches(config_get(config, "vision_config", None)) is not None else window
        patches = self.vision_patches
        return model_flops(
            config,
            self.padded_tokens if count_padding else self.tokens,
            self.seqlen_squared_sum,
            vision_patches=patches if not (isinstance(patches, int) and patches == 0) else None,
            vision_seqlen_squared_sum=self.vision_seqlen_squared_sum,
            vision_window_seqlen_squared_sum=window,
            counts={name: self._extra[name] for name in self.extra_counts if name not in _AUDIO_COUNTS} or None,
            audio_stats=self._audio_stats(),
            **options,
        )

    def _audio_stats(self) -> AudioStats | None:
        """The audio-encoder counts so far as one :class:`AudioStats`, or None without audio."""
        if _AUDIO_COUNTS[0] not in self._extra or not int(self._extra["audio_clips"]):
            return None
        return AudioStats(*(int(self._extra[name]) for name in _AUDIO_COUNTS))

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={self._get(n)}" for n in self.count_names)
        return f"FlopsAccumulator({inner})"



def _dense_length_counts(padded, rows: int, names) -> dict:
    """The length counts of the dense count of ``padded`` tokens in ``rows`` sequences of ``padded // rows``."""
    if isinstance(padded, torch.Tensor):
        return {name: rows * length_count_values(padded // rows, name) for name in names}
    return {name: rows * length_count([padded // rows], name) for name in names}


def _packed_counts(real: torch.Tensor, padded, rows: int, unknown_name: str | None, names=()) -> dict:
    """The counts of a packed micro-batch of CPU ``real`` lengths (int64 ``[B, N]``) in
    ``padded`` stream tokens, or its dense count when ``real`` holds no tokens (see
    :meth:`FlopsAccumulator.add_cu_seqlens`); ``unknown_name``: the argument to name when
    the micro-batch's token count is unknown (None: ``padded`` is known)."""
    square_sum = lengths_squared_sum(real)  # raises on a decreasing cu_seqlens first
    if square_sum == 0 and unknown_name is not None:
        raise ValueError(_unknown_tokens_message(unknown_name))
    if square_sum == 0 and padded > 0:
        return {"samples": rows, "tokens": padded, "padded_tokens": padded,
                "seqlen_squared_sum": dense_square_sum(padded, rows), **_dense_length_counts(padded, rows, names)}
    return {"samples": (real > 0).sum(), "tokens": real.sum(), "padded_tokens": padded,
            "seqlen_squared_sum": square_sum, **{name: length_count(real, name) for name in names}}


def _lazy_packed_counts(real: torch.Tensor, padded, rows: int, names=()) -> dict:
    """:func:`_packed_counts` for ``real`` on an accelerator: the dense fallback chosen by
    ``torch.where`` on the device, so that nothing is read back (no host sync)."""
    tokens = real.sum()
    dense = (tokens == 0) & (padded > 0)
    padded_t = torch.as_tensor(padded, device=real.device)
    dense_counts = _dense_length_counts(padded_t, rows, names)
    return {
        "samples": torch.where(dense, rows, (real > 0).sum()),
        "tokens": torch.where(dense, padded, tokens),
        "padded_tokens": padded,
        "seqlen_squared_sum": torch.where(dense, dense_square_sum(padded, rows), (real * real).sum()),
        **{name: torch.where(dense, dense_counts[name], length_count_values(real, name).sum()) for name in names},
    }


def _unknown_tokens_message(name: str) -> str:
    return (
        f"{name} holds no tokens before its cut and the micro-batch's token count is unknown: pass "
        "num_padded_tokens (its tokens, e.g. input_ids.numel(); 0 for an empty micro-batch) or the inputs with "
        "input_ids, so that it is counted dense (B·S²) instead of as no work"
    )


def _restarting_positions(input_ids: torch.Tensor, position_ids):
    """The positions of one packed row that restart at 0 for every sample (the text row of a
    4-row mRoPE ``[4, 1, T]``), or None: several rows, none given, or 3-row mRoPE (sample
    starts cannot be read off it)."""
    rows = input_ids.shape[0] if input_ids.ndim == 2 else 1
    if not isinstance(position_ids, torch.Tensor) or rows != 1:
        return None
    if position_ids.ndim == 3 and position_ids.shape[0] == 4:  # mRoPE with the text positions first
        position_ids = position_ids[0]
    return None if position_ids.ndim == 3 else position_ids
