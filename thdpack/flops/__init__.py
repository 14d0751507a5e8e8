"""Honest FLOPs for packed (THD) training: ``Σ sᵢ²`` from ``cu_seqlens``, model FLOPs
from a model config, TFLOP/s/GPU and MFU.

Counting a pack as one sequence of length ``pack_len`` charges causal attention
``pack_len²``; the kernels do ``Σ sᵢ²`` over the real sub-sequence lengths. Every
count here is exact integer arithmetic on what the batches actually hold.

Conventions (Megatron-LM's): docs/flops.md, "Conventions of every count".
The package does not import ``transformers``: a config is a ``transformers`` config
object or a plain dict, read by :mod:`thdpack.common.model_config`; a VL config's
``text_config`` / ``vision_config`` are used when present. See ``docs/flops.md`` for
the formulas and worked numbers. What lives where (import from here):

- :mod:`~thdpack.flops.sequences`: segment lengths, ``Σ sᵢ²``, a CP rank's share of it, a prefix tree's work,
  and the length counts of windows and top-k (:func:`length_count`: ``Σ min(t, w)`` per sample in closed form);
- :mod:`~thdpack.flops.vision_stats`: vision-tower counts from ``grid_thw`` (:class:`VisionStats`);
- :mod:`~thdpack.flops.audio_stats`: Qwen-Omni audio-encoder counts from the clips' feature frames (:class:`AudioStats`);
- :mod:`~thdpack.flops.coefficients`: a config's FLOPs per count (:func:`flops_coefficients`);
- :mod:`~thdpack.flops.layer_kinds`, :mod:`~thdpack.flops.megatron_layers`: a transformers or Megatron-style
  config read layer by layer (which mixer, which feed-forward); :mod:`~thdpack.flops.layer_costs`: what each
  kind of layer costs (:class:`UnsupportedLayerError` for a kind not covered);
- :mod:`~thdpack.flops.model`: :func:`model_flops`, :func:`model_flops_breakdown`;
- :mod:`~thdpack.flops.accumulator`: :class:`FlopsAccumulator`, counts micro-batch by micro-batch;
- :mod:`~thdpack.flops.meters`: :func:`throughput`, the GPU peak table, :class:`FlopsMeter`;
- :mod:`~thdpack.flops.overcount`: the over-count of a pack-length count;
- :mod:`~thdpack.flops.rank_work`: every rank's tokens, slots, ``Σ sᵢ²`` share and FLOPs under hybrid CP.
"""

from thdpack.flops.accumulator import FlopsAccumulator
from thdpack.flops.audio_stats import AudioStats, audio_seqlen_stats
from thdpack.flops.coefficients import UnsupportedLayerError, flops_coefficients
from thdpack.flops.meters import GPU_PEAK_TFLOPS, FlopsMeter, peak_tflops_for, throughput
from thdpack.flops.model import model_flops, model_flops_breakdown, needed_length_counts
from thdpack.flops.overcount import (TrieOvercount, attention_overcount_factor, model_overcount_factor,
                                     overcount_report, trie_overcount)
from thdpack.flops.rank_work import hybrid_cp_rank_flops
from thdpack.flops.sequences import (count_name, cp_length_count_share, cp_seqlen_squared_share, length_count,
                                      lengths_squared_sum, seqlen_squared_sum, tree_length_count,
                                      tree_seqlen_squared_sum)
from thdpack.flops.vision_stats import VisionStats, vision_seqlen_stats

__all__ = [
    "GPU_PEAK_TFLOPS",
    "AudioStats",
    "FlopsAccumulator",
    "FlopsMeter",
    "TrieOvercount",
    "UnsupportedLayerError",
    "VisionStats",
    "attention_overcount_factor",
    "audio_seqlen_stats",
    "count_name",
    "cp_length_count_share",
    "cp_seqlen_squared_share",
    "flops_coefficients",
    "hybrid_cp_rank_flops",
    "length_count",
    "lengths_squared_sum",
    "model_flops",
    "model_flops_breakdown",
    "model_overcount_factor",
    "needed_length_counts",
    "overcount_report",
    "peak_tflops_for",
    "seqlen_squared_sum",
    "throughput",
    "tree_length_count",
    "tree_seqlen_squared_sum",
    "trie_overcount",
    "vision_seqlen_stats",
]
