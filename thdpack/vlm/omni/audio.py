"""Audio clips of omni samples (Qwen2.5-Omni, Qwen3-Omni thinkers): read and check each sample's log-mel
features, and pack the clips of a pack into the two tensors the thinker's ``get_audio_features`` reads.

A sample gives its clips as ``input_features`` (the feature extractor's log-mel frames) with, when they are
padded to one width, ``feature_attention_mask`` (ones on real frames). The thinker learns each clip's
length only from ``feature_attention_mask`` (``audio_feature_lengths`` alone does not reach the audio tower),
so :func:`pack_clips` re-pads every clip of the pack to the pack's widest clip and gives the mask with it.
The audio tower cuts each clip into chunks of ``2 * n_window`` frames by those lengths, so clips of
different samples never attend to each other.

Exactness (tests/test_omni_audio.py, float32): Qwen2.5-Omni's tower gives every packed clip what it gives
the clip alone, forward and gradients. Qwen3-Omni's does only for clips whose widest chunk alone
(``min(L, 2 * n_window)``) is the call's widest chunk (every clip of ``>= 2 * n_window`` frames, for one): it
pads all chunks to the widest and runs three stride-2 convs with no mask between them, so a shorter clip
beside a longer one reads gelu(bias) columns past its end (74 of the lengths 1..99 beside a 100-frame clip;
transformers' own batched call does the same).
"""

from __future__ import annotations

import numpy as np
import torch

from thdpack.common.samples import SampleError, get_field

AUDIO_FIELDS = ("input_features", "feature_attention_mask")


def read_clips(sample, i: int) -> list[torch.Tensor]:
    """The audio clips of ``sample`` (the ``i``-th of the list, named in errors), in order, each a float
    tensor ``[mel, L_k]`` (``L_k >= 1`` frames; dtype and device as given; may be a view of the input).

    ``input_features`` (numpy array or torch tensor, any float dtype) is one of:
        ``[mel, L]``: one clip (``feature_attention_mask``, if given: ``[L]`` or ``[1, L]``);
        ``[k, mel, W]`` with ``feature_attention_mask`` ``[k, W]`` (0/1 or bool, each row ones then
        zeros): ``k`` clips padded to width ``W``, what the processor gives for one sample;
        a list or tuple of ``[mel, L_k]`` arrays / tensors (no mask).
    No ``input_features`` (absent, None, or an empty list) and no mask: no audio, ``[]``.

    Raises :class:`SampleError` (``field`` set) on: a wrong number of dims, a mask without features or
    ``[k, mel, W]`` features without a mask, a mask whose shape does not match, a mask row that is not a
    prefix of ones, an empty clip (0 frames), clips with different mel counts, a non-float dtype, and
    non-finite values in a clip's frames.
    """
    features = get_field(sample, "input_features", i)
    mask = get_field(sample, "feature_attention_mask", i)
    if features is None:
        if mask is not None:
            raise SampleError.at(i, ": 'feature_attention_mask' is given without 'input_features'",
                                 field="feature_attention_mask")
        return []
    if isinstance(features, (list, tuple)):
        if mask is not None:
            raise SampleError.at(i, ": 'feature_attention_mask' is given with a list of clips; give the clips "
                                 "as [k, mel, W] with the mask, or the list alone", field="feature_attention_mask")
        clips = [_as_tensor(f, i, "input_features") for f in features]
        for k, clip in enumerate(clips):
            if clip.ndim != 2:
                raise SampleError.at(i, f": 'input_features' clip {k} has shape {tuple(clip.shape)}; "
                                     "expected [mel, L]", field="input_features")
    else:
        clips = _unpad(_as_tensor(features, i, "input_features"), mask, i)
    _check_clips(clips, i)
    return clips


def _as_tensor(value, i: int, field: str) -> torch.Tensor:
    """``value`` (numpy array or torch tensor) as a torch tensor, sharing memory where it can."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as exc:
        raise SampleError.at(i, f": '{field}' is not an array ({type(value).__name__}: {exc})", field=field) from None


def _unpad(features: torch.Tensor, mask, i: int) -> list[torch.Tensor]:
    """The clips ``[mel, L_k]`` of ``features`` (``[mel, L]``, or ``[k, mel, W]`` cut by ``mask`` ``[k, W]``)."""
    if features.ndim == 2:
        if mask is None:
            return [features]
        mask = _as_tensor(mask, i, "feature_attention_mask")
        if mask.ndim == 1:
            mask = mask[None]
        features = features[None]
    elif features.ndim == 3:
        if mask is None:
            raise SampleError.at(i, f": 'input_features' {tuple(features.shape)} is [k, mel, W] without "
                                 "'feature_attention_mask' (the clips' lengths)", field="feature_attention_mask")
        mask = _as_tensor(mask, i, "feature_attention_mask")
    else:
        raise SampleError.at(i, f": 'input_features' has {features.ndim} dims {tuple(features.shape)}; "
                             "expected [mel, L] or [k, mel, W]", field="input_features")
    lengths = _mask_lengths(mask, (features.shape[0], features.shape[2]), i)
    return [features[k, :, :n] for k, n in enumerate(lengths)]


def _mask_lengths(mask: torch.Tensor, shape: tuple[int, int], i: int) -> list[int]:
    """Frames per row of ``mask`` (``shape`` ``(k, W)``), each row ones then zeros."""
    if tuple(mask.shape) != shape:
        raise SampleError.at(i, f": 'feature_attention_mask' has shape {tuple(mask.shape)}; expected "
                             f"{list(shape)} (clips, width of 'input_features')", field="feature_attention_mask")
    if mask.is_floating_point() or mask.is_complex():
        raise SampleError.at(i, f": 'feature_attention_mask' has dtype {mask.dtype}; expected integers or bools",
                             field="feature_attention_mask")
    m = mask.detach().to("cpu", torch.int64)
    if m.numel() and not bool(((m == 0) | (m == 1)).all()):
        raise SampleError.at(i, ": 'feature_attention_mask' holds values other than 0 and 1",
                             field="feature_attention_mask")
    lengths = m.sum(dim=1)
    prefix = torch.arange(shape[1])[None, :] < lengths[:, None]
    bad = torch.nonzero((prefix.to(torch.int64) != m).any(dim=1)).flatten().tolist()
    if bad:
        raise SampleError.at(i, f": 'feature_attention_mask' row {bad[0]} is not ones then zeros",
                             field="feature_attention_mask")
    return lengths.tolist()


def _check_clips(clips: list[torch.Tensor], i: int) -> None:
    """The clip checks of :func:`read_clips`: float dtype, frames, one mel count, finite values."""
    for k, clip in enumerate(clips):
        if not clip.is_floating_point():
            raise SampleError.at(i, f": 'input_features' has dtype {clip.dtype}; expected floats (log-mel)",
                                 field="input_features")
        if clip.shape[1] == 0:
            raise SampleError.at(i, f": audio clip {k} of 'input_features' is empty (0 frames)",
                                 field="input_features")
        if clip.shape[0] != clips[0].shape[0]:
            raise SampleError.at(i, f": audio clip {k} of 'input_features' has {clip.shape[0]} mel bins, "
                                 f"clip 0 has {clips[0].shape[0]}", field="input_features")
        if not bool(torch.isfinite(clip).all()):
            raise SampleError.at(i, f": audio clip {k} of 'input_features' holds non-finite values",
                                 field="input_features")


def pack_clips(clips: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The clips of a pack (each ``[mel, L_k]``, pack order) as the thinker's audio inputs.

    Returns ``(input_features, feature_attention_mask)``:
        ``input_features``: ``[k, mel, W]``, ``W = max L_k``, clip ``k`` in ``[k, :, :L_k]`` and zeros after
        it; dtype and device of the clips.
        ``feature_attention_mask``: int64 ``[k, W]``, ones on the ``L_k`` real frames of each row.
    ``get_audio_features(input_features, feature_attention_mask)`` then cuts every clip into its own chunks
    (Qwen2.5-Omni: exactly as alone; Qwen3-Omni: see the module docstring for short clips). No clips: ``(None, None)``, what the thinker takes as "no audio"
    (a ``[0, mel, 0]`` tensor has no mel count to give).

    Raises ``ValueError`` when the clips differ in mel count, dtype or device.
    """
    if not clips:
        return None, None
    first = clips[0]
    for k, clip in enumerate(clips):
        if clip.ndim != 2 or clip.shape[0] != first.shape[0]:
            raise ValueError(f"audio clip {k} has shape {tuple(clip.shape)}; expected [{first.shape[0]}, L] "
                             "like clip 0")
        if clip.dtype != first.dtype or clip.device != first.device:
            raise ValueError(f"audio clip {k} is {clip.dtype} on {clip.device}, clip 0 is {first.dtype} on "
                             f"{first.device}; cast the samples' input_features to one dtype")
    lengths = feature_lengths(clips)
    width = int(lengths.max())
    features = first.new_zeros((len(clips), first.shape[0], width))
    for k, clip in enumerate(clips):
        features[k, :, : clip.shape[1]] = clip
    mask = (torch.arange(width, device=first.device)[None, :]
            < torch.as_tensor(lengths, device=first.device)[:, None]).to(torch.int64)
    return features, mask


def feature_lengths(clips: list[torch.Tensor]) -> np.ndarray:
    """int64 ``[k]``: the frames ``L_k`` of each clip (``[mel, L_k]``), what ``feature_attention_mask.sum(1)``
    gives the thinker."""
    return np.array([clip.shape[-1] for clip in clips], dtype=np.int64)
