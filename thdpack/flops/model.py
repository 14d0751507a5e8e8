"""Model FLOPs of packed training: the coefficients of a config
(:mod:`thdpack.flops.coefficients`) times the counts of the batches
(:mod:`thdpack.flops.sequences`, :mod:`thdpack.flops.vision_stats`, :mod:`thdpack.flops.audio_stats`),
per term or in total.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from thdpack.common.model_config import config_get
from thdpack.flops.audio_stats import AudioStats, audio_config_of, audio_family, audio_seqlen_stats
from thdpack.flops.coefficients import flops_coefficients
from thdpack.flops.layer_kinds import model_root
from thdpack.flops.sequences import check_count, length_count, parse_count_name
from thdpack.flops.vision_stats import vision_seqlen_stats

__all__ = ["model_flops", "model_flops_breakdown", "needed_length_counts"]


def _as_count(x):
    """A count as the multiplier of an int coefficient: tensors in float64 (no overflow, no
    host sync), numpy scalars as Python ints, anything else as given."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64)
    if isinstance(x, np.generic):
        return int(x)
    return x


def _check_counts(num_tokens, seqlen_squared_sum, vision_patches, vision_seqlen_squared_sum,
                  vision_window_seqlen_squared_sum) -> None:
    """Every count given to :func:`model_flops_breakdown` is an integer >= 0 (:func:`check_count`)."""
    check_count(num_tokens, "num_tokens")
    check_count(seqlen_squared_sum, "seqlen_squared_sum", square_sum=True)
    for name, value, square_sum in (("vision_patches", vision_patches, False),
                                    ("vision_seqlen_squared_sum", vision_seqlen_squared_sum, True),
                                    ("vision_window_seqlen_squared_sum", vision_window_seqlen_squared_sum, True)):
        if value is not None:
            check_count(value, name, square_sum=square_sum)


_OTHER_COUNTS = ("cross_tokens", "cross_seqlen_product_sum")
_COEFFICIENT_OPTIONS = ("gated_mlp", "attention_output_gate", "layer_types", "vision_gated_mlp", "vision_backward",
                        "audio_backward", "mtp_layers")


def needed_length_counts(config, **options) -> tuple[str, ...]:
    """The length counts beyond ``Σ sᵢ²`` the model of ``config`` needs (``"window_square_sum[4096]"``,
    ``"causal_pairs[2048]"``, ...; :attr:`FlopsCoefficients.length_counts`); ``options`` as
    :func:`model_flops`'s (only those of :func:`flops_coefficients` matter)."""
    picked = {k: v for k, v in options.items() if k in _COEFFICIENT_OPTIONS}
    return flops_coefficients(config, include_vision=False, include_audio=False, **picked).length_counts


def _extra_counts(counts, seq_lens) -> dict:
    """The counts beyond tokens, ``Σ sᵢ²`` and vision (``counts``: ``{name: value}``), checked; with
    ``seq_lens`` (real lengths), any length count asked for later is computed from them."""
    out = {}
    for name, value in (counts or {}).items():
        if name not in _OTHER_COUNTS:
            parse_count_name(name)
        check_count(value, f"counts[{name!r}]", square_sum=True)
        out[name] = value
    return out


def _audio_counts(config, audio_stats, audio_feature_lengths) -> dict:
    """The audio encoder's counts (``audio_*``) of :func:`model_flops_breakdown`, from ``audio_stats`` (an
    :class:`AudioStats`) or ``audio_feature_lengths`` (one encoder call's clips); {} without audio."""
    if audio_feature_lengths is not None:
        if audio_stats is not None:
            raise ValueError("pass audio_feature_lengths or audio_stats, not both")
        audio_stats = audio_seqlen_stats(audio_feature_lengths, config)
    if audio_stats is None:
        return {}
    if not isinstance(audio_stats, AudioStats):
        raise TypeError(f"audio_stats must be an AudioStats (audio_seqlen_stats), got {type(audio_stats).__name__}")
    counts = {f"audio_{k}": v for k, v in dataclasses.asdict(audio_stats).items()}
    for name, value in counts.items():
        check_count(value, name, square_sum=name == "audio_seqlen_squared_sum")
    if audio_stats.frames == 0 and audio_stats.tokens == 0:
        return {}
    if audio_family(audio_config_of(config)) is None:
        raise ValueError("audio counts given but the config has no Qwen-Omni audio encoder (audio_config with "
                         "n_window)")
    return counts


def model_flops_breakdown(
    config,
    num_tokens,
    seqlen_squared_sum,
    *,
    counts=None,
    seq_lens=None,
    vision_patches=None,
    vision_seqlen_squared_sum=None,
    vision_window_seqlen_squared_sum=None,
    vision_grid_thw=None,
    audio_stats=None,
    audio_feature_lengths=None,
    **options,
) -> dict:
    """Training FLOPs per term (see :func:`flops_coefficients`), as a dict ``{term: FLOPs}``;
    :func:`model_flops` is their sum. Arguments as :func:`model_flops`: ``vision_patches``,
    ``vision_seqlen_squared_sum``, ``vision_window_seqlen_squared_sum`` are the vision
    tower's counts, or ``vision_grid_thw`` computes them; ``counts`` the window, top-k and
    cross-attention counts (``{"window_square_sum[4096]": ..., "causal_pairs[2048]": ...}``,
    :meth:`FlopsAccumulator.counts` gives them), or ``seq_lens`` (the real sample lengths, one
    array) computes the length counts; ``audio_stats`` (:class:`AudioStats`) the audio encoder's
    counts, or ``audio_feature_lengths`` (one encoder call's clips, mel frames each) computes them;
    ``options`` go to :func:`flops_coefficients`. Every count
    must be an integer >= 0 (``ValueError`` naming it otherwise; :func:`thdpack.flops.sequences.check_count`).
    """
    _check_counts(num_tokens, seqlen_squared_sum, vision_patches, vision_seqlen_squared_sum,
                  vision_window_seqlen_squared_sum)
    if vision_grid_thw is not None:
        if vision_patches is not None:
            raise ValueError("pass vision_grid_thw or the vision counts, not both")
        stats = vision_seqlen_stats(vision_grid_thw, config)
        vision_patches = stats.patches
        vision_seqlen_squared_sum = stats.seqlen_squared_sum
        vision_window_seqlen_squared_sum = stats.window_seqlen_squared_sum
    has_vision = vision_patches is not None and not (isinstance(vision_patches, int) and vision_patches == 0)
    audio = _audio_counts(config, audio_stats, audio_feature_lengths)
    coefficients = flops_coefficients(config, include_vision=has_vision, include_audio=bool(audio), **options)
    if has_vision and config_get(model_root(config), "vision_config", None) is None:
        raise ValueError("vision counts given but the config has no vision_config")
    values = {
        "tokens": num_tokens,
        "seqlen_squared_sum": seqlen_squared_sum,
        "vision_patches": vision_patches,
        "vision_seqlen_squared_sum": vision_seqlen_squared_sum,
        "vision_window_seqlen_squared_sum": vision_window_seqlen_squared_sum,
        **audio,
        **_extra_counts(counts, seq_lens),
    }
    out = {}
    for name, (count, coefficient) in coefficients.terms.items():
        value = values.get(count)
        if value is None and seq_lens is not None and count.startswith(("window_square_sum", "causal_pairs")):
            value = values[count] = length_count(seq_lens, count)
        if value is None:
            raise ValueError(_missing_count_message(name, count))
        out[name] = coefficient * _as_count(value)
    return out


def _missing_count_message(term: str, count: str) -> str:
    if count.startswith("audio"):
        return (f"{term} needs {count}: pass audio_stats= (thdpack.flops.audio_seqlen_stats) "
                "or audio_feature_lengths=")
    if count.startswith("vision"):
        return (f"{term} needs {count}: pass it (thdpack.flops.vision_seqlen_stats computes the vision sums) "
                "or vision_grid_thw")
    if count.startswith("cross"):
        return (f"{term} needs {count}: pass counts={{{count!r}: ...}} (FlopsAccumulator counts it from "
                "cross_cu_seqlens, the memory's cumulative lengths)")
    return (f"{term} needs {count}, which Σ sᵢ² does not give: pass counts={{{count!r}: ...}} or seq_lens=, or count "
            "the batches with FlopsAccumulator(config), which adds it up for this model")


def model_flops(config, num_tokens, seqlen_squared_sum, **vision_counts_and_options):
    """Training FLOPs (forward + backward) of a model on packed batches.

    Details: docs/flops.md, "model_flops in one formula".

    Args:
        config: a ``transformers`` config or a dict (VL configs: ``text_config`` and
            ``vision_config`` are used).
        num_tokens: tokens through the language model (real tokens; padded ones to
            count the work done on pad slots too).
        seqlen_squared_sum: ``Σ sᵢ²`` (:func:`seqlen_squared_sum`).
            Counts are integers >= 0 (a Python / numpy int, a one-element integer CPU
            tensor; ``Σ`` sums may pass int64), else ``ValueError`` naming the argument;
            tensors on an accelerator are used unchecked (reading them would sync).
        vision_counts_and_options: keywords of :func:`model_flops_breakdown`:
            ``counts`` (window, top-k and cross-attention counts by name) or ``seq_lens``;
            ``vision_patches``, ``vision_seqlen_squared_sum``,
            ``vision_window_seqlen_squared_sum``, the vision tower's counts
            (:class:`VisionStats`), or ``vision_grid_thw`` (image and video grids
            concatenated) to compute them; ``audio_stats`` (:class:`AudioStats`) or
            ``audio_feature_lengths`` (the clips' mel frames) for a Qwen-Omni audio
            encoder; and the options ``gated_mlp``,
            ``attention_output_gate``, ``layer_types``, ``vision_gated_mlp``,
            ``vision_backward``, ``audio_backward``, ``mtp_layers`` (see :func:`flops_coefficients`).

    Returns:
        A Python int when the counts are ints; a float64 tensor (on the counts'
        device, no host sync) when any count is a tensor.
    """
    return sum(model_flops_breakdown(config, num_tokens, seqlen_squared_sum, **vision_counts_and_options).values())

