"""Optional integrations with training frameworks.

Each submodule imports its framework itself; importing ``thdpack.integrations``
imports none of them.

- :mod:`thdpack.integrations.hf_trainer`: a ``transformers`` ``TrainerCallback``
  that logs TFLOP/s/GPU and MFU from the batches a ``Trainer`` actually trains on.
"""

__all__ = ["FlopsCallback", "hf_collator"]


def __getattr__(name):
    if name in __all__:
        from thdpack.integrations import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
