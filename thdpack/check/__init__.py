"""``thdpack check``: prove packing exact on your own model and data, layer by layer, and say where it breaks.

:func:`check_packing` runs a model on a pack and on each of its samples alone and compares every decoder
layer, sequence mixer (attention, linear attention, SSM, convolution) and mixer step, the logits, the loss
and the gradients; the :class:`CheckReport` names the first module where a sample differs and what that
module reads to keep samples apart. :func:`check_dataset` does it for a seeded sample of a dataset's packs
(a packed build as built, a build config or a JSON Lines file planned on the fly). docs/check.md.
"""

from thdpack.check.compare import check_packing
from thdpack.check.dataset_check import check_dataset
from thdpack.check.report import CheckReport

__all__ = ["CheckReport", "check_dataset", "check_packing"]
