"""Optional integrations with training frameworks.

Each submodule imports its framework itself; importing ``thdpack.integrations``
imports none of them.

- :mod:`thdpack.integrations.hf_trainer`: a ``transformers`` ``TrainerCallback``
  that logs TFLOP/s/GPU and MFU from the batches a ``Trainer`` actually trains on.
- :mod:`thdpack.integrations.varlen_attention`: :func:`register_varlen_attention`, PyTorch's own varlen flash
  kernel as a transformers attention backend (an exact per-sample reference on the CPU).
- :mod:`thdpack.integrations.hybrid`: :func:`packed_model`, which makes a transformers model (hybrids
  with linear-attention, SSM and short-convolution layers included) exact on packs on any machine.
"""

__all__ = ["FlopsCallback", "hf_collator", "packed_model", "register_varlen_attention"]


def __getattr__(name):
    if name == "register_varlen_attention":
        from thdpack.integrations.varlen_attention import register_varlen_attention

        return register_varlen_attention
    if name == "packed_model":
        from thdpack.integrations.hybrid import packed_model

        return packed_model
    if name in __all__:
        from thdpack.integrations import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
