"""Which transformers version's mRoPE rule a VLM batch follows (``mrope_convention``).

The Qwen-VL families' ``get_rope_index`` changed twice in transformers, so the same
sample gets different mRoPE positions depending on the version a model runs under.
A model should be trained on the positions its own inference computes, so thdpack
follows, by default, the rule of the transformers installed where the batch is built
(read from its package metadata; transformers is never imported). The rules:

``"exact"`` (transformers >= 5.18; checked against 5.18.0 and 5.24.0)
    Qwen2.5-VL video frame ``k`` is at ``p + trunc(k · tokens_per_second · second_per_grid_ts)``;
    after a vision item the next position is ``p + max(h, w)`` (LLM grid).
``"truncate-spg"`` (transformers 5.6 to 5.17; checked against each of 5.6.0 … 5.17.0)
    As ``"exact"`` but ``second_per_grid_ts`` is truncated first:
    ``k · tokens_per_second · int(second_per_grid_ts)`` (0.5 s per grid gives 0).
    Only Qwen2.5-VL videos differ from ``"exact"``.
``"transformers-4"`` (transformers 4.x up to 5.2; checked against 4.57.6, 5.0.0, 5.1.0, 5.2.0)
    ``second_per_grid_ts`` truncated as in ``"truncate-spg"``; Qwen2.5-VL images have
    temporal position ``p`` on every frame; after a vision item the next position is one
    past the largest position of the item: ``p + max(last temporal offset + 1, h, w)``.
    Megatron-Bridge's own THD Qwen3-VL ``get_rope_index`` (``modelling_qwen3_vl/rope.py``)
    follows this rule.

Details: docs/vlm.md, "mRoPE conventions: where they differ".
"""

from __future__ import annotations

import re
import warnings
from functools import lru_cache
from importlib import metadata

EXACT = "exact"
TRUNCATE_SPG = "truncate-spg"
TRANSFORMERS_4 = "transformers-4"
INSTALLED = "transformers-installed"
CONVENTIONS = (EXACT, TRUNCATE_SPG, TRANSFORMERS_4)


def convention_for_transformers(version: str) -> str:
    """The mRoPE convention of transformers ``version`` (e.g. ``"5.12.1"``, ``"5.18.0.dev0"``)."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if match is None:
        raise ValueError(
            f"mrope_convention: cannot read a transformers version from {version!r}; give 'MAJOR.MINOR[...]'"
        )
    major, minor = int(match.group(1)), int(match.group(2))
    if (major, minor) >= (5, 18):
        return EXACT
    if (major, minor) >= (5, 3):
        if (major, minor) <= (5, 5):
            warnings.warn(
                f"mrope_convention: transformers {version}'s Qwen-VL get_rope_index mis-places items with t > 1 "
                "and Qwen2.5-VL videos (fixed in 5.6); thdpack follows 'truncate-spg': use transformers >= 5.6",
                stacklevel=3,
            )
        return TRUNCATE_SPG
    return TRANSFORMERS_4


@lru_cache(maxsize=1)
def installed_transformers_version() -> str | None:
    """The installed transformers' version from its package metadata, or None (not installed);
    read once per process (a metadata scan costs about 0.5 ms, a batch is built per step)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def resolve_mrope_convention(value: str | None = None) -> str:
    """One of :data:`CONVENTIONS` for ``value``: a convention name, ``"transformers-installed"``
    (or None) for the installed transformers' rule, or ``"transformers==VERSION"`` for that
    version's rule. Raises ValueError naming the accepted values."""
    if value is None or value == INSTALLED:
        version = installed_transformers_version()
        return EXACT if version is None else convention_for_transformers(version)
    if value in CONVENTIONS:
        return value
    if isinstance(value, str) and value.startswith("transformers=="):
        return convention_for_transformers(value[len("transformers=="):])
    raise ValueError(
        f"mrope_convention={value!r} is not known; use {INSTALLED!r} (the default), 'transformers==VERSION' "
        f"or one of {', '.join(repr(c) for c in CONVENTIONS)}"
    )
