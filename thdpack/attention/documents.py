"""Document ids of a THD stream: the sample each slot belongs to, from ``cu_seqlens_padded``.

Every attention layout of :mod:`thdpack.attention` reads the documents of this module, so
they agree slot for slot. The rule: slot ``t`` belongs to sample ``i`` when
``cu_seqlens_padded[i] <= t < cu_seqlens_padded[i + 1]``, its padded span. So

- alignment pad slots belong to the sample before them (``position_ids`` continue its count,
  and flash-attn varlen over ``cu_seqlens_padded`` puts them in its segment too);
- a ``pad_to`` tail belongs to the last sample (``build_thd_batch`` extends the last padded
  span to reach ``pad_to``);
- slots past ``cu_seqlens_padded[-1]``, in a stream longer than its offsets
  (``total > cu_seqlens_padded[-1]``), extend the last span in the same way;
- empty spans (repeated offsets, e.g. ``cu_seqlens`` padded to a static length by repeating the
  last value) hold no slot and are skipped.

A pad slot may attend to its sample's real tokens; no real token attends to a pad slot (pads
come after the real tokens of their span, and attention is causal), so each sample's outputs
are those it has alone.

Example: ``cu_seqlens_padded = [0, 4, 8]`` with real lengths 3 and 2, ``total = 10``::

    slot          0 1 2 3 | 4 5 6 7 | 8 9
    tokens        a a a . | b b . . | . .
    document_ids  0 0 0 0 | 1 1 1 1 | 1 1
"""

from __future__ import annotations

import torch

from thdpack.common.align import check_int, integer_array


def check_offsets(cu_seqlens_padded, total, name: str = "cu_seqlens_padded") -> tuple[torch.Tensor, int]:
    """``(cu, total)``: the offsets as an int64 tensor (on the input's device: a list or numpy
    array gives a CPU tensor) and the stream length as a Python int (``cu[-1]`` when ``total`` is
    None). ``ValueError`` naming the bad value unless ``cu`` is 1-D with at least two entries,
    starts at 0, never decreases, and ``total >= max(cu[-1], 1)``. Reads the values (a host sync for
    accelerator tensors)."""
    cu = integer_array(cu_seqlens_padded, name)
    cu = cu.to(torch.int64) if isinstance(cu, torch.Tensor) else torch.from_numpy(cu.astype("int64"))
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries (one sample), got shape {tuple(cu.shape)}")
    steps = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((steps < 0).any()):
        raise ValueError(f"{name} must start at 0 and never decrease, got {_shown(cu)}")
    end = int(cu[-1])
    if total is None:
        if end == 0:
            raise ValueError(f"{name} describes an empty stream ({_shown(cu)}); give total >= 1 or some tokens")
        return cu, end
    check_int(total, "total", max(end, 1), hint=f" (the stream length; {name}[-1] is {end})")
    return cu, int(total)


def documents_of(cu: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """int64 document of each stream position in ``slots`` (any shape), by the rule of this module.
    ``cu``: validated int64 ``[n+1]`` offsets on the device of ``slots``. Vectorised: a binary search
    over the ``n - 1`` inner offsets, so a position past ``cu[-1]`` gets the last sample."""
    return torch.searchsorted(cu[1:-1].contiguous(), slots, right=True)


def document_starts(cu: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """int64 first slot of the document of each position in ``slots`` (``cu[documents_of(...)]``):
    position ``q`` may attend to ``kv`` exactly when ``document_starts(q) <= kv <= q``."""
    return cu[documents_of(cu, slots)]


def document_ids_from_offsets(cu_seqlens_padded, total: int | None = None, *, device=None) -> torch.Tensor:
    """The sample of every slot of a THD stream (the rule: this module's docstring), from its offsets (a batch's:
    :func:`thdpack.batching.document_ids`).

    Args:
        cu_seqlens_padded: int ``[n+1]`` cumulative padded lengths (a torch tensor on any device,
            a numpy array or a list): starts at 0, never decreases.
        total: the stream length ``T`` (default ``cu_seqlens_padded[-1]``); at least
            ``cu_seqlens_padded[-1]``, slots past it belong to the last sample.
        device: where to build the result (default: the device of ``cu_seqlens_padded``).

    Returns:
        int32 ``[T]``, values in ``[0, n)``, non-decreasing.
    """
    cu, total = check_offsets(cu_seqlens_padded, total)
    cu = cu.to(device) if device is not None else cu
    return documents_of(cu, torch.arange(total, device=cu.device)).to(torch.int32)


def _shown(cu: torch.Tensor) -> str:
    values = cu[:9].tolist()
    return "[" + ", ".join(map(str, values[:8])) + (", ...]" if len(values) > 8 else "]")
