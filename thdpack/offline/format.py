"""The packed dataset on disk.

A packed dataset is a directory::

    metadata.json                   written last: its presence means the build completed
    data-00000-of-00002.arrow       Arrow IPC stream shards (or .parquet), one row per pack
    data-00001-of-00002.arrow
    tokenizer/                      optional copy of the tokenizer (save_pretrained)

Each row is one pack, its samples (or sample pieces) back to back:

=================  =================  =====================================================
column             Arrow type         meaning
=================  =================  =====================================================
``input_ids``      list<int32>        the pack's real tokens (no alignment padding)
``loss_mask``      list<bool>         1 = the token is a target (is predicted from the
                                      token before it, within its sample); or instead:
``labels``         list<int32>        HF-style unshifted labels, -100 = no loss
``seq_lens``       list<int32>        real length of each sample, in stream order
``sample_index``   list<int64>        input row of each sample
``sample_start``   list<int32>        first token of each piece within its input row
                                      (non-zero only for ``overflow="split"`` pieces)
=================  =================  =====================================================

Alignment padding is not stored: the loader's collator adds it for the CP/TP/FP8
multiple in use (``metadata.json`` records the multiple the plan reserved room for).
Arrow shards are what ``datasets`` writes too: ``datasets.Dataset.from_file`` reads them.
"""

import hashlib
from pathlib import Path

FORMAT_NAME = "thdpack.packed"
FORMAT_VERSION = 1  # what text builds write
VLM_FORMAT_VERSION = 2  # VLM builds: + pixel_values, image_grid_thw, image_counts (thdpack/offline/vlm.py)
MAX_FORMAT_VERSION = 2  # what load_packed reads
METADATA_FILE = "metadata.json"
TOKENIZER_DIR = "tokenizer"
LIST_COLUMNS = ("input_ids", "loss_mask", "labels", "seq_lens", "sample_index", "sample_start")
SAMPLE_COLUMNS = ("seq_lens", "sample_index", "sample_start")  # one entry per sample of the pack
SUFFIX = {"arrow": ".arrow", "parquet": ".parquet"}


def shard_name(i: int, n: int, file_format: str) -> str:
    return f"data-{i:05d}-of-{n:05d}{SUFFIX[file_format]}"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read 4 MiB at a time (the checksums ``metadata.json`` records)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
