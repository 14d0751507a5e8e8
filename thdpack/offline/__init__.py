"""Offline pack building and loading.

Build (``thdpack build`` or :func:`build_packed`): read a dataset (JSON Lines,
Parquet, Arrow, ``save_to_disk``), tokenize it (text, chat template, or already
tokenized) with ``datasets.map``, plan packs on lengths only, and write one row per
pack to Arrow or Parquet data files with ``metadata.json``, atomically.

Load (:func:`load_packed`): a map-style dataset of packs; its :meth:`~PackedDataset.collator`
turns rows into :class:`thdpack.ThdBatch` es.

Importing this package is cheap: ``datasets`` / ``transformers`` are imported only by
the build, ``pyarrow`` only when a dataset is opened.
"""

from thdpack.offline.config import BuildConfig
from thdpack.offline.stage_options import RayOptions
from thdpack.offline.store.dataset import PackedDataset, PackedRowCollator, load_packed, read_metadata, unpack_row
from thdpack.offline.errors import ConfigError, InputError, NotPackedError, OfflineError, OutputExistsError


def build_packed(*args, **kwargs):
    """See :func:`thdpack.offline.commands.build_packs.build_packed`."""
    from thdpack.offline.commands.build_packs import build_packed as _build

    return _build(*args, **kwargs)


__all__ = [
    "BuildConfig",
    "ConfigError",
    "InputError",
    "NotPackedError",
    "OfflineError",
    "OutputExistsError",
    "PackedDataset",
    "PackedRowCollator",
    "RayOptions",
    "build_packed",
    "load_packed",
    "read_metadata",
    "unpack_row",
]
