"""Per-sample values carried through packing: a weight, a reward, an advantage, a domain id
travels with its sample into the pack (``batch.sample_values[name]``, ``[n]``) and is
broadcast to its tokens on demand (``batch.token_values(name)``, ``[T]``), on a CP shard too.

Planning needs nothing: a pack's samples are known by position, and the values are read from
the samples when the pack is built (``build_thd_batch(..., sample_values=names)``,
``ThdCollator(sample_values=names)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from thdpack.common.samples import SampleError, get_field

PREFIX = "sample_values."  # a batch keeps value `name` as batch.extras["sample_values." + name]: moved by .to()


def read_sample_values(samples: Sequence, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """``{name: [n] or [n, k]}`` each sample's value of every field in ``names``.

    A field holds one number per sample (int64 if every value is an integer, else float64) or a
    vector of the same length ``k`` for every sample. ``SampleError`` names the sample and the
    field that is missing, not numeric, not finite (NaN or ±inf: it would reach the loss as NaN)
    or of another length. Bools count as the integers 0 and 1.
    """
    if isinstance(names, str):
        names = (names,)
    return {name: _read_one(samples, name) for name in names}


def _read_one(samples: Sequence, name: str) -> torch.Tensor:
    rows = []
    for i, sample in enumerate(samples):
        value = get_field(sample, name, i)
        if value is None:
            raise SampleError.at(
                i, f" has no '{name}' value; every sample needs one when sample_values names it",
                field=name,
            )
        arr = np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value)
        if arr.dtype.kind not in "biuf" or arr.ndim > 1:
            raise SampleError.at(
                i, f": '{name}' is {value!r}; a per-sample value is a number or a 1-D vector of numbers",
                field=name,
            )
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise SampleError.at(
                i, f": '{name}' is {value!r}; a per-sample value must be finite (a NaN or infinite reward reaches "
                "the loss as NaN): drop the sample or replace the value", field=name,
            )
        if rows and arr.shape != rows[0].shape:
            raise SampleError.at(i, f": '{name}' has shape {arr.shape}, sample 0's has {rows[0].shape}; give every "
                                    "sample the same shape", field=name)
        rows.append(arr)
    stacked = np.stack(rows)
    dtype = np.float64 if stacked.dtype.kind == "f" else np.int64
    return torch.from_numpy(stacked.astype(dtype))


def sample_ids(batch) -> torch.Tensor:
    """int64 ``[T]`` the sample (position in the pack) of every slot of the (local) stream, pad
    slots included. On a CP shard each sample's local span is ``P / cp_size`` slots."""
    cu = batch.shard.local_cu_seqlens_padded if batch.is_shard else batch.cu_seqlens_padded
    cu = cu.to(torch.int64)
    counts = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(counts.numel(), device=cu.device), counts,
                                   output_size=int(cu[-1]))


def attach_sample_values(batch, samples: Sequence, names: Sequence[str]) -> None:
    """Read ``names`` from ``samples`` (the batch's samples, in pack order) into ``batch``."""
    for name, value in read_sample_values(samples, names).items():
        batch.extras[PREFIX + name] = value


def batch_sample_values(batch) -> dict[str, torch.Tensor]:
    """The batch's per-sample values (empty when built without ``sample_values``)."""
    return {k[len(PREFIX):]: v for k, v in batch.extras.items() if k.startswith(PREFIX)}


def token_values(batch, name: str) -> torch.Tensor:
    """``[T]`` (or ``[T, k]``) sample ``name``'s value on every slot of its sample (pad slots
    included; mask with ``batch.loss_mask`` for targets only)."""
    values = batch_sample_values(batch)
    if name not in values:
        raise KeyError(
            f"batch has no per-sample value {name!r} (it has {sorted(values)}); build it with "
            f"sample_values=[{name!r}, ...]"
        )
    v = values[name]
    return v[sample_ids(batch).to(v.device)]
