"""torchtitan's attention helpers for the tests, imported without ``torchtitan.models.common``'s ``__init__``.

That ``__init__`` imports the whole model zoo (MoE, ...), which pulls triton, not installable
next to a CPU build of torch; ``torchtitan.models.common.attention`` itself needs only torch,
``spmd_types`` and torchtitan's small utility modules. So the package is registered here as an
empty namespace over its directory, and the attention module is imported from it as it is:
torchtitan's own code, unchanged. (torchtitan is installed ``--no-deps``; see the test extra.)
"""

from __future__ import annotations

import pathlib
import sys
import types

import pytest

torchtitan = pytest.importorskip("torchtitan")
import torchtitan.models  # noqa: E402

_BASE = pathlib.Path(torchtitan.__file__).parent / "models" / "common"
if "torchtitan.models.common" not in sys.modules:
    _package = types.ModuleType("torchtitan.models.common")
    _package.__path__ = [str(_BASE)]
    sys.modules["torchtitan.models.common"] = _package

from torchtitan.models.common.attention import (  # noqa: E402
    create_varlen_metadata_for_document,
    get_causal_mask_mod,
    get_document_mask_mod,
)

__all__ = ["create_varlen_metadata_for_document", "get_causal_mask_mod", "get_document_mask_mod"]
