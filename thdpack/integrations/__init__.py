"""Optional integrations with training frameworks.

Each submodule imports its framework itself; importing ``thdpack.integrations``
imports none of them.

- :mod:`thdpack.integrations.hf_trainer`: a ``transformers`` ``TrainerCallback``
  that logs TFLOP/s/GPU and MFU from the batches a ``Trainer`` actually trains on.
- :mod:`thdpack.integrations.varlen_attention`: :func:`register_varlen_attention`, PyTorch's own varlen flash
  kernel as a transformers attention backend (an exact per-sample reference on the CPU).
- :mod:`thdpack.integrations.hybrid`: :func:`packed_model`, which makes a transformers model (hybrids
  with linear-attention, SSM and short-convolution layers included) exact on packs on any machine.
- :mod:`thdpack.integrations.hf_kwargs`: :func:`to_hf_kwargs`, a batch as a transformers model's keywords.
- :mod:`thdpack.integrations.megatron_core`: :func:`to_packed_seq_params` (and ``packed_seq_params_dict``),
  a batch as megatron-core's ``PackedSeqParams``.
- :mod:`thdpack.integrations.megatron_steps`: :class:`MegatronSteps`, a pipeline-parallel step's micro-batches as
  megatron-core's ``forward_backward_func`` reads them (the middle stages: boundaries without tokens).
"""

__all__ = ["FlopsCallback", "hf_collator", "packed_model", "register_varlen_attention", "to_hf_kwargs",
           "to_packed_seq_params", "packed_seq_params_dict", "MegatronSteps"]


def __getattr__(name):
    if name == "register_varlen_attention":
        from thdpack.integrations.varlen_attention import register_varlen_attention

        return register_varlen_attention
    if name == "to_hf_kwargs":
        from thdpack.integrations.hf_kwargs import to_hf_kwargs

        return to_hf_kwargs
    if name in ("to_packed_seq_params", "packed_seq_params_dict"):
        from thdpack.integrations import megatron_core

        return getattr(megatron_core, name)
    if name == "MegatronSteps":
        from thdpack.integrations.megatron_steps import MegatronSteps

        return MegatronSteps
    if name == "packed_model":
        from thdpack.integrations.hybrid import packed_model

        return packed_model
    if name in __all__:
        from thdpack.integrations import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
