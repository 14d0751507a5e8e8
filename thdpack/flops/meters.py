"""Throughput of a training run: TFLOP/s per GPU and MFU against a table of GPU peaks
(:data:`GPU_PEAK_TFLOPS`), and :class:`FlopsMeter`, which counts a plain training loop
step by step with a :class:`thdpack.flops.FlopsAccumulator`.
"""

from __future__ import annotations

import torch

from thdpack.common.align import check_int, check_number
from thdpack.common.model_config import check_config
from thdpack.flops.accumulator import FlopsAccumulator
from thdpack.flops.coefficients import flops_coefficients

__all__ = ["GPU_PEAK_TFLOPS", "FlopsMeter", "peak_tflops_for", "throughput"]

# Dense (no sparsity) BF16 tensor-core peaks per GPU, TFLOP/s, from the vendors' data sheets.
# Edit or pass ``peak_tflops=`` for other GPUs, clocks or precisions.
GPU_PEAK_TFLOPS = {
    "A100": 312.0,
    "A800": 312.0,
    "H100": 989.0,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H800": 989.0,
    "H200": 989.0,
    "GH200": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "GB200": 2500.0,
    "L40S": 362.0,
    "MI300X": 1307.0,
}


def peak_tflops_for(device_name: str | None = None) -> float | None:
    """Peak BF16 TFLOP/s for a GPU name (the longest :data:`GPU_PEAK_TFLOPS` key it
    contains, case-insensitive); the current CUDA device when ``device_name`` is None.
    None when unknown."""
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    name = device_name.lower()
    matches = [k for k in GPU_PEAK_TFLOPS if k.lower() in name]
    return GPU_PEAK_TFLOPS[max(matches, key=len)] if matches else None


def throughput(flops, seconds: float, world_size: int = 1, peak_tflops: float | str | None = None) -> dict:
    """TFLOP/s per GPU and MFU.

    Args:
        flops: FLOPs done by ``world_size`` GPUs in ``seconds`` (e.g. :func:`thdpack.flops.model_flops`
            of the global batch of a step).
        seconds: wall-clock time of that work.
        world_size: GPUs that shared the work.
        peak_tflops: the GPU's peak TFLOP/s, or a GPU name looked up in
            :data:`GPU_PEAK_TFLOPS`; None detects the current CUDA device.

    Returns:
        ``{"tflops_per_gpu": flops / seconds / world_size / 1e12, "mfu": tflops_per_gpu
        / peak (None when the peak is unknown), "peak_tflops": peak}``.
    """
    check_number(seconds, "seconds", positive=True)
    check_int(world_size, "world_size", 1)
    check_number(float(flops) if isinstance(flops, torch.Tensor) else flops, "flops", positive=False)
    peak_tflops = peak_tflops_for() if peak_tflops is None else resolve_peak(peak_tflops)
    tflops = float(flops) / seconds / world_size / 1e12
    return {"tflops_per_gpu": tflops, "mfu": tflops / peak_tflops if peak_tflops else None, "peak_tflops": peak_tflops}


def resolve_peak(peak_tflops: float | str) -> float:
    """A peak TFLOP/s given as a number (positive, finite) or a GPU name (:data:`GPU_PEAK_TFLOPS`); a
    one-line ValueError naming ``peak_tflops``, what was given and the known names otherwise."""
    if isinstance(peak_tflops, str):
        peak = GPU_PEAK_TFLOPS.get(peak_tflops, peak_tflops_for(peak_tflops))
        if peak is None:
            raise ValueError(f"peak_tflops must be a positive number or a known GPU name "
                             f"({', '.join(sorted(GPU_PEAK_TFLOPS))}), got unknown GPU {peak_tflops!r}")
        return peak
    check_number(peak_tflops, "peak_tflops", positive=True)
    return float(peak_tflops)


class FlopsMeter:
    """TFLOP/s/GPU and MFU per step of a plain training loop::

        meter = FlopsMeter(model.config)
        for step, micro_batches in enumerate(loader):
            t0 = time.perf_counter()
            for batch in micro_batches:
                meter.update(batch)          # ThdBatch, CP shard, model-input dict, ...
                ...forward / backward...
            optimizer.step(); torch.cuda.synchronize()
            print(meter.step(time.perf_counter() - t0))   # {"tflops_per_gpu": ..., "mfu": ...}

    Args:
        config: model config (object or dict).
        all_reduce: sum the counts over ``group`` at every :meth:`step` (default: when
            ``torch.distributed`` is initialized). ``group`` must be the ranks that see
            different data (data parallel × context parallel).
        group: the process group (None: the default group).
        world_size: GPUs sharing the counted work; default: the world size when
            all-reducing, else 1 (pass tensor × pipeline parallel size then).
        peak_tflops: GPU peak (number or name), None to detect.
        count_padding: charge the linear terms for padded tokens too.
        flops_options: passed to :func:`thdpack.flops.model_flops` (``gated_mlp``, ``vision_backward``, ...).

    ``history`` holds one record per step; :meth:`summary` averages over all steps.
    """

    def __init__(self, config, *, all_reduce: bool | None = None, group=None, world_size: int | None = None,
                 peak_tflops: float | str | None = None, count_padding: bool = False, **flops_options):
        import torch.distributed as dist

        check_config(config)
        distributed = dist.is_available() and dist.is_initialized()
        self.config = config
        self.all_reduce = distributed if all_reduce is None else all_reduce
        self.group = group
        if world_size is None:
            world_size = dist.get_world_size() if (self.all_reduce and distributed) else 1
        check_int(world_size, "world_size", 1)
        self.world_size = world_size
        self.peak_tflops = None if peak_tflops is None else resolve_peak(peak_tflops)  # an unknown GPU fails here
        self.count_padding = count_padding
        self.flops_options = flops_options
        self.accumulator = FlopsAccumulator(config)
        self.history: list[dict] = []
        flops_coefficients(config, **flops_options)  # fail now on an unsupported config

    def update(self, batch) -> None:
        """Count one micro-batch."""
        self.accumulator.add(batch)

    def step(self, seconds: float) -> dict:
        """Close a step that took ``seconds``: reduce, compute, reset. Returns the record
        (``model_flops``, ``seconds``, ``tflops_per_gpu``, ``mfu``, ``peak_tflops`` and the counts).
        ``seconds`` is a positive finite number (``ValueError`` before anything is reduced or reset)."""
        check_number(seconds, "seconds", positive=True)
        acc = self.accumulator
        if self.all_reduce:
            acc.all_reduce(self.group)
        flops = acc.model_flops(self.config, count_padding=self.count_padding, **self.flops_options)
        if isinstance(flops, torch.Tensor):
            flops = float(flops)
        record = {"step": len(self.history) + 1, "seconds": float(seconds), "model_flops": flops}
        record.update(throughput(flops, seconds, self.world_size, self.peak_tflops))
        record.update(acc.counts())
        self.history.append(record)
        acc.reset()
        return record

    def summary(self) -> dict:
        """Totals over all steps: ``model_flops``, ``seconds``, ``tflops_per_gpu``, ``mfu``."""
        flops = sum(r["model_flops"] for r in self.history)
        seconds = sum(r["seconds"] for r in self.history)
        out = {"steps": len(self.history), "model_flops": flops, "seconds": seconds}
        if seconds > 0:
            out.update(throughput(flops, seconds, self.world_size, self.peak_tflops))
        return out

