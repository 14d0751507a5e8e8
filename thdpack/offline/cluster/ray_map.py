"""The tokenizing map on Ray: :func:`map_on_ray`, :func:`thdpack.offline.procs.map_in_processes`'s work on a
pool of Ray actors.

The rows come in parts (:class:`DatasetParts` of a file-backed ``datasets.Dataset``, which pickles as its
file paths, or an input's :class:`~thdpack.offline.inputs.file_parts.FileParts`, read where they run). The
parts and the row tokenizer are put in the object store once; each actor takes both once, when it starts
(the tokenizer is deserialised once per actor, not per part), then reads part after part and maps it with
``datasets.map`` into ``part_file(cache_file_name, r, parts)`` exactly as a local worker maps its share.
Only part numbers, row counts and what ``summarize`` keeps of each part come back: the driver never
opens the part files. They stay where they were written, in order (:class:`PartFiles`: the same rows,
and the same table, as the local map), and are opened where they are read (the workers that write the
packs), memory-mapped.

An actor that dies (killed, out of memory) is replaced and its part run again, up to ``ray_max_retries``
times per part (:class:`~thdpack.offline.cluster.ray_wait.Retries`); once more stops the build with a line
naming the input rows of the part. A part's file is written to a temporary name and moved into place by
``datasets`` only when complete, so a part run again overwrites nothing half-written. An exception raised
by the map itself (a row tokenizer's) is raised here as it was raised there.

Why actors of Ray core and not a Ray Data ``map_batches``: a Ray Data execution costs ~7 s of
start-up on a 2-CPU machine before its first part (measured: 16 one-row parts in 6.6–8.7 s against
under 2 s here), and its blocking iterator holds the driver in Ray's code, where a Ctrl-C cannot be
acted on at a checkpoint of ours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from thdpack.offline.cluster.ray_session import RaySession, import_ray
from thdpack.offline.cluster.ray_wait import Retries, collect
from thdpack.offline.procs import part_file

PARTS_PER_ACTOR = 4  # parts per actor: progress and retries in smaller steps, a straggler matters less


def num_parts(num_rows: int, actors: int, batch_size: int) -> int:
    """Parts of ``num_rows`` rows for ``actors`` actors: :data:`PARTS_PER_ACTOR` each, but never a part
    smaller than one ``batch_size`` batch (at least one part)."""
    return max(1, min(actors * PARTS_PER_ACTOR, num_rows // max(1, batch_size)))


def part_bounds(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of ``parts`` contiguous parts, as ``Dataset.shard(contiguous=True)`` cuts them."""
    div, mod = divmod(num_rows, parts)
    starts = [div * r + min(r, mod) for r in range(parts)]
    return [(a, a + div + (r < mod)) for r, a in enumerate(starts)]


class DatasetParts:
    """A file-backed ``datasets.Dataset`` (``ds``) in ``parts`` contiguous parts (``Dataset.shard``); ``name``:
    the input, for messages. The parts protocol :func:`map_on_ray` reads: ``num_parts``, ``part_rows(r)``,
    ``describe(r)``, ``read(r)`` (a ``datasets.Dataset``)."""

    def __init__(self, ds, parts: int, name: str = "the input"):
        self.ds, self.num_parts, self.name = ds, parts, name
        self.bounds = part_bounds(len(ds), parts)

    def part_rows(self, r: int) -> int:
        a, b = self.bounds[r]
        return b - a

    def describe(self, r: int) -> str:
        a, b = self.bounds[r]
        return f"{self.name} rows {a}..{b - 1}"

    def read(self, r: int):
        return self.ds.shard(num_shards=self.num_parts, index=r, contiguous=True)


class PartFiles:
    """The part files of a map, in order: the rows ``datasets.concatenate_datasets`` of them holds, opened
    (memory-mapped) where they are first read (:attr:`data`, as a ``datasets.Dataset``'s), pickled as their paths.
    ``columns``: only these (the part files of several maps, a mixture's sources)."""

    def __init__(self, paths: list[str], columns: list[str] | None = None):
        self.paths, self.columns = list(paths), columns
        self._dataset = None

    @property
    def dataset(self):
        """The rows, a ``datasets.Dataset`` of the part files (opened here, once)."""
        if self._dataset is None:
            import datasets

            parts = [datasets.Dataset.from_file(p) for p in self.paths]
            if self.columns is not None:  # several sources' part files (a mixture): the columns they share
                parts = [d.select_columns(self.columns) for d in parts]
                parts = [d if d.features == parts[0].features else d.cast(parts[0].features) for d in parts]
            self._dataset = datasets.concatenate_datasets(parts)
        return self._dataset

    @property
    def data(self):
        return self.dataset.data

    def __getstate__(self):
        return {"paths": self.paths, "columns": self.columns, "_dataset": None}


@dataclass(frozen=True)
class MappedParts:
    """What :func:`map_on_ray` gives back: the part files and ``summarize``'s result for each part, in order."""

    files: PartFiles
    summaries: list


def map_on_ray(session: RaySession, rows, function, *, cache_file_name: str, new_fingerprint: str,
               desc: str | None = None, progress: bool = True, name: str = "the input", summarize=None,
               **map_kwargs) -> MappedParts:
    """``rows.map(function, ...)`` (batched) on the actors of ``session``: see the module docstring. ``rows``:
    a file-backed ``datasets.Dataset`` (``thdpack.offline.inputs.mmap_input.memory_mapped``; ``name`` says what
    it holds) or the parts of an input (``FileParts``). ``summarize(path)`` runs where a part was mapped, on its
    part file (e.g. the lengths and the small columns of the rows): what the driver keeps of it.
    ``with_indices=True`` gives ``function`` the rows' indices in all of ``rows``."""
    import datasets
    from tqdm.auto import tqdm

    if not map_kwargs.get("batched"):
        raise ValueError("map_on_ray: pass batched=True (it maps batches)")
    ray = import_ray()
    if isinstance(rows, datasets.Dataset):
        rows = DatasetParts(rows, num_parts(len(rows), session.actors, map_kwargs.get("batch_size") or 1000), name)
    parts = rows.num_parts
    sizes = [rows.part_rows(r) for r in range(parts)]
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist()
    shared = [ray.put(rows), ray.put(function), ray.put(map_kwargs), ray.put(summarize)]  # refs, not copies
    mapper = ray.remote(num_cpus=session.options.cpus_per_actor, max_restarts=0, max_task_retries=0)(_PartMapper)
    actors = [mapper.remote(cache_file_name, new_fingerprint, parts) for _ in range(min(session.actors, parts))]

    def replace(dead):
        ray.kill(dead, no_restart=True)
        actors.append(mapper.remote(cache_file_name, new_fingerprint, parts))
        return actors[-1]

    bar = tqdm(total=starts[-1], desc=f"{desc or 'Map'} (ray, {len(actors)} actors)", unit=" examples",
               disable=not progress)
    summaries: list = [None] * parts

    def done(r, result):
        summaries[r] = result[1]
        bar.update(result[0])

    try:
        collect(actors, [(r, lambda actor, r=r: actor.map_part.remote(shared, r, starts[r])) for r in range(parts)],
                on_done=done, replace=replace,
                retries=Retries(session.options.max_retries, lambda r: f"tokenizing {rows.describe(r)}"))
    finally:
        bar.close()
        for actor in actors:
            ray.kill(actor, no_restart=True)
    return MappedParts(PartFiles([part_file(cache_file_name, r, parts) for r in range(parts)]), summaries)


class _PartMapper:
    """A Ray actor mapping parts of the shared rows with the shared row tokenizer."""

    def __init__(self, cache_file_name: str, new_fingerprint: str, parts: int):
        import datasets

        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one CPU per actor: no thread pool of Rust tokenizers
        datasets.disable_progress_bars()
        self.cache_file_name, self.new_fingerprint, self.parts = cache_file_name, new_fingerprint, parts
        self.rows = self.function = self.map_kwargs = self.summarize = None

    def map_part(self, shared: list, r: int, start: int) -> tuple:
        """Map part ``r`` (its first row: ``start`` of all the rows) into its part file; the rows mapped and the
        ``summarize`` of the part file (None without). ``shared``: the refs of the parts, the function, the map's
        arguments and ``summarize``, fetched at the actor's first part (a list, so that Ray passes the refs, not
        their values)."""
        import ray

        if self.rows is None:
            self.rows, self.function, self.map_kwargs, self.summarize = ray.get(shared)
        part = self.rows.read(r).with_format("arrow")
        assert len(part) == self.rows.part_rows(r), (r, len(part), self.rows.part_rows(r))
        fn = _Shifted(self.function, start) if self.map_kwargs.get("with_indices") else self.function
        path = part_file(self.cache_file_name, r, self.parts)
        part.map(fn, **dict(self.map_kwargs, cache_file_name=path,
                            new_fingerprint=f"{self.new_fingerprint}_{r:05d}_of_{self.parts:05d}"))
        return len(part), None if self.summarize is None else self.summarize(path)


class _Shifted:
    """The map function with the rows' indices shifted from the part to the whole dataset."""

    def __init__(self, function, offset: int):
        self.function, self.offset = function, offset

    def __call__(self, batch, indices):
        return self.function(batch, [i + self.offset for i in indices])
