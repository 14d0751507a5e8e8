"""The collectives under :func:`thdpack.rebalance`: the process group and its device, samples
and per-sample values as bytes, and one uneven all-to-all of those bytes.

What crosses the network, and how:

* ``all_gather_object`` of one small record per rank (lengths, group ids, encoded sizes, an
  error message or None). Ranks hold different numbers of samples: fixed-size tensors would
  need a count all-gather first and padding, which is what ``all_gather_object`` does inside
  (sizes, then bytes); and it carries a rank's local error to every rank, so that all of them
  raise it instead of the others hanging in the next collective.
* ``all_to_all_single`` with split sizes of one ``uint8`` tensor (the samples' bytes, later the
  values'). torch 2.13's gloo backend supports uneven splits there (its list form
  ``all_to_all`` does not: "ProcessGroupGloo::alltoall: invalid tensor size"), NCCL too.

Samples are pickled (protocol 5) with their tensors as numpy arrays, about 20x faster to
pickle than torch tensors; dtypes numpy lacks (bfloat16, ...) travel as same-width integers.
Pickle runs code on load: peers of one training job trust each other, as
``torch.distributed``'s own ``*_object`` collectives assume.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from thdpack.parallel.groups import GROUP, check_process_group

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Comm:
    """A process group as :func:`thdpack.rebalance` uses it.

    ``group``: a ``torch.distributed`` group, or None for one process (world size 1, no
    collective is called). ``device``: where collective buffers live (CUDA for NCCL).
    """

    group: object
    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def of(cls, group) -> "Comm":
        """``group`` (None: the default group) resolved; a single process when
        ``torch.distributed`` is not initialised (then ``group`` must be None). A :class:`Comm`
        is returned as it is (a subclass may carry its own transport: tests run ranks as threads)."""
        if isinstance(group, Comm):
            return group
        check_process_group(group, "group", f"{GROUP}, a thdpack.loaders.exchange.Comm or None")
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ValueError(f"group={group!r} was given but torch.distributed is not initialised; call "
                                 "init_process_group first, or pass group=None for one process")
            return cls(None, 0, 1, torch.device("cpu"))
        group = dist.group.WORLD if group is None else group
        backend = str(dist.get_backend(group))
        device = torch.device("cpu")
        if "nccl" in backend and "gloo" not in backend:
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(group, dist.get_rank(group), dist.get_world_size(group), device)

    def all_gather_object(self, record) -> list:
        """Every rank's ``record``, in rank order."""
        if self.world_size == 1:
            return [record]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, record, group=self.group)
        return out

    def all_to_all(self, send: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int]) -> torch.Tensor:
        """One ``all_to_all_single``: ``send`` (``[Σ in_splits, ...]``, rows ``in_splits[d]`` to
        rank ``d``) in, the rows every rank sent here (``[Σ out_splits, ...]``, rank order) out,
        on ``send``'s device."""
        if self.world_size == 1:
            return send
        import torch.distributed as dist

        source = send.to(self.device)
        out = torch.empty((int(sum(out_splits)), *send.shape[1:]), dtype=send.dtype, device=self.device)
        dist.all_to_all_single(out, source.contiguous(), [int(k) for k in out_splits],
                               [int(k) for k in in_splits], group=self.group)
        return out.to(send.device)


# --------------------------------------------------------------------------- samples as bytes


def encode_sample(sample: Mapping) -> bytes:
    """``sample`` (a mapping) as bytes that :func:`decode_sample` turns back into a dict: its
    tensors as numpy arrays (moved to the CPU), every other value as pickle keeps it."""
    plain, tensors = {}, {}
    for key, value in sample.items():
        if isinstance(value, torch.Tensor):
            value, tensors[key] = _tensor_to_numpy(value)
        plain[key] = value
    return pickle.dumps((plain, tensors), protocol=5)


def decode_sample(blob) -> dict:
    """The dict :func:`encode_sample` encoded (``blob``: bytes or a memoryview), its tensors
    torch tensors again (on the CPU)."""
    plain, tensors = pickle.loads(blob)
    for key, dtype in tensors.items():
        value = torch.from_numpy(plain[key])
        plain[key] = value if dtype is None else value.view(getattr(torch, dtype))
    return plain


def _tensor_to_numpy(value: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """``(array, None)``, or ``(same-width integer view, torch dtype name)`` for dtypes numpy lacks."""
    value = value.detach().cpu()
    try:
        return value.numpy(), None
    except TypeError:  # bfloat16, float8, ...: numpy has no such dtype
        width = value.element_size()
        return value.contiguous().view(_SAME_WIDTH_INT[width]).numpy(), str(value.dtype).removeprefix("torch.")


def exchange_blobs(comm: Comm, send: list[list[bytes]], receive_sizes: list[np.ndarray]) -> list[list[memoryview]]:
    """Send ``send[d]`` (encoded items, in order) to every rank ``d`` in one all-to-all.

    ``receive_sizes[s]``: int64 ``[k]`` the sizes of the ``k`` items rank ``s`` sends here.
    Returns, per source rank, its items as memoryviews over one receive buffer.
    """
    in_splits = [sum(len(b) for b in blobs) for blobs in send]
    out_splits = [int(sizes.sum()) for sizes in receive_sizes]
    buffer = bytearray().join(b for blobs in send for b in blobs)
    source = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
    received = memoryview(comm.all_to_all(source, in_splits, out_splits).numpy())
    out, at = [], 0
    for sizes in receive_sizes:
        ends = at + np.cumsum(sizes)
        out.append([received[a:b] for a, b in zip([at, *ends[:-1].tolist()], ends.tolist())])
        at = int(ends[-1]) if sizes.size else at
    return out


# --------------------------------------------------------------------------- values back


def exchange_rows(comm: Comm, rows: torch.Tensor, send_counts: np.ndarray, receive_counts: np.ndarray) -> torch.Tensor:
    """``rows`` (``[n, ...]``, any dtype, ``send_counts[d]`` rows to rank ``d`` in order) sent in
    one all-to-all of their bytes; returns ``[Σ receive_counts, ...]`` of the same dtype and trailing
    shape, on ``rows``' device. Every rank must give the same dtype and trailing shape."""
    shape, dtype = rows.shape[1:], rows.dtype
    width = rows.element_size() * int(np.prod(shape, dtype=np.int64))  # bytes per row
    as_bytes = rows.detach().contiguous().reshape(-1).view(torch.uint8)
    out = comm.all_to_all(as_bytes, [int(k) * width for k in send_counts], [int(k) * width for k in receive_counts])
    return out.view(dtype).reshape(int(receive_counts.sum()), *shape)


def exchange_objects(comm: Comm, values: list, send_counts: np.ndarray, receive_counts: np.ndarray) -> list:
    """Python objects (``send_counts[d]`` of ``values`` to rank ``d`` in order), pickled: one
    all-to-all of their sizes (int64), one of their bytes. Returns the received objects in rank order."""
    blobs = [pickle.dumps(v, protocol=5) for v in values]
    sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
    received_sizes = comm.all_to_all(sizes, send_counts.tolist(), receive_counts.tolist()).numpy()
    send, at = [], 0
    for k in send_counts.tolist():
        send.append(blobs[at:at + k])
        at += k
    per_source = np.split(received_sizes, np.cumsum(receive_counts)[:-1])
    return [pickle.loads(item) for items in exchange_blobs(comm, send, per_source) for item in items]
