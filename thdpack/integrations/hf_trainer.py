"""TFLOP/s/GPU and MFU in a ``transformers.Trainer`` run, from the batches it trains on.

A ``TrainerCallback`` alone never sees a batch, so :meth:`FlopsCallback.attach`
wraps the trainer's ``training_step`` (on the instance; any subclass keeps its own
override) with a function that counts ``inputs`` and then calls the original
unchanged. The count happens in the main process, on exactly the micro-batches
that are trained on, in order (DataLoader workers and prefetching do not matter)::

    trainer = Trainer(model=model, args=args, train_dataset=packs, data_collator=hf_collator(ThdCollator()))
    FlopsCallback(peak_tflops="H100").attach(trainer)
    trainer.train()      # every log gains "tflops_per_gpu", "mfu" and "model_flops"

Nothing about training changes: the inputs, the loss, ``state.total_flos`` and the
optimizer are untouched; the only side effect is an optional
``torch.cuda.synchronize()`` at the end of each step so the step time is the GPU's.

What is counted (see :class:`thdpack.flops.FlopsAccumulator`): ``cu_seq_lens_q``
when the inputs carry it (thdpack's ``to_hf_kwargs``, transformers'
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), else the restarts of
``position_ids`` in a packed row, else ``B·S²`` for a padded ``[B, S]`` batch
(the legacy count); ``image_grid_thw`` / ``video_grid_thw`` for the vision tower.
transformers' kernels run over the stream layout they are given, pad slots
included, so that is what is counted.
"""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

from thdpack.common.align import check_bool
from thdpack.flops import FlopsMeter, flops_coefficients, throughput
from thdpack.integrations.hf_kwargs import to_hf_kwargs

__all__ = ["FlopsCallback", "hf_collator"]


def hf_collator(collator, model=None):
    """Wrap a thdpack collator (:class:`thdpack.ThdCollator`) into a ``data_collator``
    for ``transformers.Trainer``: each :class:`thdpack.ThdBatch` becomes
    ``to_hf_kwargs(batch)`` (a dict with a batch axis of 1).

    With ``model`` (the model the trainer trains), the batches carry the attention inputs of its
    ``config._attn_implementation`` (the mask for sdpa / eager / flex), and the model is made exact on packs
    first (:func:`thdpack.integrations.packed_model`: hybrid layers get their sample boundaries)::

        trainer = Trainer(model=model, ..., data_collator=hf_collator(ThdCollator(), model=model))
    """
    attn = None
    if model is not None:
        from thdpack.integrations.hybrid import packed_model

        packed_model(model)
        attn = getattr(model.config, "_attn_implementation", None)

    def collate(samples):
        return to_hf_kwargs(collator(samples), attn_implementation=attn)

    return collate


class FlopsCallback(TrainerCallback):
    """Log TFLOP/s/GPU and MFU per step of a ``transformers.Trainer``.

    Use ``FlopsCallback(...).attach(trainer)`` (adds the callback first in the
    trainer's list, so reporting integrations see the metrics, and wraps
    ``training_step`` to see the batches).

    Args:
        config: model config; default ``model.config`` at ``on_train_begin``.
        peak_tflops: GPU peak (TFLOP/s or a name from
            :data:`thdpack.flops.GPU_PEAK_TFLOPS`); None detects the CUDA device.
        world_size: GPUs sharing the counted work; default ``args.world_size`` when
            all-reducing, else 1.
        all_reduce: sum the counts over ``group`` each step (default: when
            ``torch.distributed`` is initialized). ``group`` must hold the ranks that
            see different data (for plain DDP / FSDP: all ranks).
        group: the process group (None: default group).
        include_data_time: time a step from the previous step's end (data loading
            included; evaluation and checkpointing excluded) instead of from
            ``on_step_begin``.
        synchronize: ``torch.cuda.synchronize()`` before reading the clock at a step
            end; default: when the model is on CUDA.
        count_padding: charge linear terms for padded tokens (see :class:`FlopsMeter`).
        flops_options: passed to :func:`thdpack.flops.model_flops`.

    Each log gets ``model_flops`` (summed over the steps since the last log and over
    the reduced ranks), ``tflops_per_gpu`` and ``mfu`` (when the peak is known);
    ``history`` keeps one record per optimizer step (see :meth:`FlopsMeter.step`).
    """

    def __init__(self, config=None, *, peak_tflops=None, world_size=None, all_reduce=None, group=None,
                 include_data_time: bool = False, synchronize: bool | None = None, count_padding: bool = False,
                 **flops_options):
        self.config = config
        self.peak_tflops = peak_tflops
        self.world_size = world_size
        self.all_reduce = None if all_reduce is None else check_bool(all_reduce, "all_reduce")
        self.group = group
        self.include_data_time = check_bool(include_data_time, "include_data_time")
        self.synchronize = None if synchronize is None else check_bool(synchronize, "synchronize")
        self.count_padding = check_bool(count_padding, "count_padding")
        self.flops_options = flops_options
        self.meter: FlopsMeter | None = None
        self._pending: list[dict] = []
        self._t_start: float | None = None
        if config is not None:
            flops_coefficients(config, **flops_options)  # fail now on an unsupported config

    # ---- wiring ----------------------------------------------------------
    def attach(self, trainer) -> "FlopsCallback":
        """Install on ``trainer``: first in its callback list, and counting the
        ``inputs`` of every ``training_step`` call. Idempotent."""
        if getattr(trainer, "_thdpack_flops_callback", None) is self:
            return self
        original = trainer.training_step

        def training_step(model, inputs, *args, **kwargs):
            self.observe(inputs)
            return original(model, inputs, *args, **kwargs)

        trainer.training_step = training_step
        trainer.callback_handler.callbacks.insert(0, self)
        trainer._thdpack_flops_callback = self
        return self

    def observe(self, inputs) -> None:
        """Count one micro-batch (the dict the model is called with)."""
        if self.meter is None:
            raise RuntimeError("FlopsCallback starts counting at on_train_begin: attach it before trainer.train()")
        self.meter.update(inputs)

    def _make_meter(self, config, args) -> None:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        all_reduce = distributed if self.all_reduce is None else self.all_reduce
        world_size = self.world_size
        if world_size is None and args is not None:
            world_size = args.world_size if all_reduce else 1
        self.meter = FlopsMeter(config, all_reduce=all_reduce, group=self.group, world_size=world_size,
                                peak_tflops=self.peak_tflops, count_padding=self.count_padding, **self.flops_options)

    @property
    def history(self) -> list[dict]:
        return self.meter.history if self.meter is not None else []

    # ---- events ----------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        config = self.config if self.config is not None else getattr(model, "config", None)
        if config is None:
            raise ValueError("FlopsCallback needs config=... when the model has no .config")
        self._make_meter(config, args)
        if self.synchronize is None:
            self.synchronize = model is not None and any(p.is_cuda for p in model.parameters())
        self._t_start = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self._t_start is None or not self.include_data_time:
            self._t_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.synchronize and torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        record = self.meter.step(now - self._t_start)
        record["step"] = state.global_step
        self._pending.append(record)
        self._t_start = now if self.include_data_time else None

    def on_evaluate(self, args, state, control, **kwargs):
        self._t_start = None  # evaluation time is not training time

    def on_save(self, args, state, control, **kwargs):
        self._t_start = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._pending or logs is None:
            return
        flops = sum(r["model_flops"] for r in self._pending)
        seconds = sum(r["seconds"] for r in self._pending)
        self._pending = []
        rates = throughput(flops, seconds, self.meter.world_size, self.meter.peak_tflops)
        metrics = {"model_flops": flops, "tflops_per_gpu": rates["tflops_per_gpu"]}
        if rates["mfu"] is not None:
            metrics["mfu"] = rates["mfu"]
        # Trainer.log appended {**logs, "step": ...} to log_history just before on_log: keep it in step.
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and {k: v for k, v in last.items() if k != "step"} == logs:
            last.update(metrics)
        logs.update(metrics)
