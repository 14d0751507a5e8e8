"""Hand ``datasets.map`` workers a memory-mapped file instead of a pickled table.

``Dataset.map(num_proc=N)`` pickles each worker's part of an in-memory dataset (the
rows read from JSON Lines or Parquet): a copy of the input in the parent while it
pickles and one in every worker. A dataset backed by an Arrow file pickles as its
path, and the workers map the same pages. Writing the rows once to the build's work
directory costs about what pickling them costs.
"""

from __future__ import annotations

from pathlib import Path


def memory_mapped(ds, path: Path):
    """``ds`` (a ``datasets.Dataset`` without an indices mapping) backed by an Arrow file at
    ``path``; ``ds`` itself when it already is file-backed."""
    import datasets
    import pyarrow as pa

    if ds.cache_files or ds._indices is not None:
        return ds
    table = ds.data.table
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=10_000):
            writer.write_batch(batch)
    return datasets.Dataset.from_file(str(path), info=ds.info)
