"""The layout of a built batch: how each sample is padded and aligned, what fills the
pad slots, and which CP rank's shard is built. Defined once here; :func:`thdpack.build_thd_batch`,
:class:`thdpack.ThdCollator`, :func:`thdpack.rebalance`, :class:`thdpack.offline.PackedRowCollator`
and ``thdpack.shard(samples, plan=, rank=)`` take its fields as keywords alone (:func:`layout_of` builds it);
code holding one hands it on as ``**layout.keywords()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from thdpack.attention.static import check_max_num_seqs
from thdpack.common.align import check_int, check_positive_int, resolve_pad_multiple, round_up
from thdpack.parallel.cp import check_cp_args
from thdpack.common.samples import IGNORE_INDEX


@dataclass(frozen=True)
class BatchLayout:
    """How samples sit in a THD stream; every field is validated on construction.

    Attributes:
        pad_token_id: fills alignment pad slots of ``input_ids`` (an integer >= 0).
        ignore_index: label value of non-targets (an integer).
        cp_size, tp_size, sequence_parallel: each sample is padded to the least
            multiple these need (:func:`thdpack.cp_pad_multiple`).
        pad_multiple: an extra multiple (e.g. 16 for FP8), combined by lcm.
        max_length: bound on each sample's *padded* length: a sample keeps its
            first ``max_length // m · m`` tokens, ``m`` the pad multiple (so
            ``max_length=pack_size`` cuts exactly where ``plan_packs(...,
            overflow="truncate")`` does). Cut tokens are counted in
            ``batch.tokens_truncated``.
        pad_to: pad the whole stream to exactly this many tokens (static shapes,
            CUDA graphs) by extending the last sample's padded span; must be a
            multiple of the pad multiple and at least the aligned total. Real
            ``cu_seqlens`` are unchanged. The tail is the last sample's: its ``position_ids``
            continue that sample's count and ``seq_idx`` gives it that sample's id (a causal
            layer's real tokens never see it).
        max_num_seqs: the most samples a batch holds (an integer >= 1, or None): docs/attention.md,
        "BatchLayout.max_num_seqs".
        cp_rank: with ``cp_size > 1``, build only this rank's CP shard (as
            ``thdpack.shard(batch, cp_size=, cp_rank=)`` would), assembled directly without the
            whole stream.
        multiple: (derived) the multiple every padded length is rounded up to.
    """

    pad_token_id: int = 0
    ignore_index: int = IGNORE_INDEX
    cp_size: int = 1
    tp_size: int = 1
    sequence_parallel: bool = False
    pad_multiple: int | None = None
    max_length: int | None = None
    pad_to: int | None = None
    cp_rank: int | None = None
    max_num_seqs: int | None = None
    multiple: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        check_token_args(self.pad_token_id, self.ignore_index)
        multiple = resolve_pad_multiple(self.cp_size, self.tp_size, self.sequence_parallel, self.pad_multiple)
        object.__setattr__(self, "multiple", multiple)
        if self.max_length is not None:
            check_positive_int(self.max_length, "max_length")
            if self.max_length < multiple:
                raise ValueError(f"max_length={self.max_length} is smaller than the pad multiple {multiple}; nothing fits")
        pad_to = self.pad_to
        if pad_to is not None:
            check_int(pad_to, "pad_to", 1, hint=f" (a multiple of the pad multiple {multiple})")
            if pad_to % multiple:
                raise ValueError(f"pad_to must be an integer multiple of the pad multiple {multiple}, got {pad_to!r}")
        check_max_num_seqs(self.max_num_seqs)
        if self.cp_rank is not None:
            check_cp_args(self.cp_size, self.cp_rank)

    def keywords(self) -> dict:
        """The fields as the keywords of :func:`thdpack.build_thd_batch` (what built this layout)."""
        return {name: getattr(self, name) for name in LAYOUT_FIELDS}

    @property
    def cut_length(self) -> int | None:
        """``max_length`` rounded down to the pad multiple: the tokens a sample keeps."""
        return None if self.max_length is None else self.max_length // self.multiple * self.multiple


LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(BatchLayout) if f.init)


def layout_of(owner: str, keywords: dict) -> BatchLayout:
    """The :class:`BatchLayout` of ``keywords`` (its fields, as a caller of ``owner`` passed them);
    ``TypeError`` naming ``owner`` for ``layout=`` (:func:`refuse_layout_object`) or any other keyword."""
    refuse_layout_object(owner, keywords)
    unknown = sorted(set(keywords) - set(LAYOUT_FIELDS))
    if unknown:
        raise TypeError(f"{owner}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    return BatchLayout(**keywords)


def refuse_layout_object(owner: str, keywords: dict) -> None:
    """``TypeError`` naming ``owner`` if ``keywords`` holds ``layout``: a layout is taken one way, its fields."""
    if "layout" in keywords:
        raise TypeError(f"{owner}() takes the BatchLayout fields as keywords (pad_token_id=, cp_size=, ...), "
                        "not layout=; hand a held layout on as **layout.keywords()")


def check_token_args(pad_token_id, ignore_index) -> None:
    """``ValueError`` naming the argument unless ``pad_token_id`` is an integer >= 0
    (a token id) and ``ignore_index`` any int64 integer."""
    hint = " (use the tokenizer's pad_token_id, or its eos_token_id when it has none)" if pad_token_id is None else ""
    check_int(pad_token_id, "pad_token_id", 0, hint=hint)
    check_int(ignore_index, "ignore_index", None)


_INT32_MAX = np.iinfo(np.int32).max


def padded_lengths(seq_lens: np.ndarray, layout: BatchLayout) -> np.ndarray:
    """int64 ``[n]`` padded lengths: ``seq_lens`` rounded up to the layout's multiple, the
    last extended to ``pad_to``; ``ValueError`` if the stream overflows int32 offsets."""
    padded = round_up(seq_lens, layout.multiple)
    if layout.pad_to is not None:
        padded = _extend_last(padded, layout.pad_to)
    total = int(padded.sum())
    if total > _INT32_MAX:
        raise ValueError(f"pack of {total} tokens does not fit int32 cu_seqlens")
    return padded


def _extend_last(padded: np.ndarray, pad_to: int) -> np.ndarray:
    """int64 ``[n]`` ``padded`` with the last span extended so the total is ``pad_to``."""
    aligned_total = int(padded.sum())
    if pad_to < aligned_total:
        raise ValueError(f"pad_to={pad_to} is shorter than the pack ({aligned_total} tokens after alignment)")
    padded = padded.copy()
    padded[-1] += pad_to - aligned_total
    return padded
