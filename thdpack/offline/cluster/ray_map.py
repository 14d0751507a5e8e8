"""The tokenizing map on Ray: :func:`map_on_ray`, :func:`thdpack.offline.procs.map_in_processes`'s contract
on a pool of Ray actors.

The rows (a file-backed ``datasets.Dataset``, which pickles as its file paths) and the row
tokenizer are put in the object store once; each actor takes both once, when it starts (the
tokenizer is deserialised once per actor, not per part), then maps contiguous parts of the rows
with ``datasets.map`` into ``part_file(cache_file_name, r, parts)`` exactly as a local worker does.
Only part numbers and row counts come back; the driver concatenates the part files in order: the
same rows, and the same table, as the local map.

Actors are restarted and their part retried when their process dies (``max_restarts`` /
``max_task_retries``): a part's file is written to a temporary name and moved into place by
``datasets`` only when complete, so a retried part overwrites nothing half-written. An exception
raised by the map itself (a row tokenizer's) is raised here as it was raised there.

Why actors of Ray core and not a Ray Data ``map_batches``: a Ray Data execution costs ~7 s of
start-up on a 2-CPU machine before its first part (measured: 16 one-row parts in 6.6–8.7 s against
under 2 s here), and its blocking iterator holds the driver in Ray's code, where a Ctrl-C cannot be
acted on at a checkpoint of ours.
"""

from __future__ import annotations

import os

from thdpack.offline.cluster.ray_session import RaySession, import_ray
from thdpack.offline.cluster.ray_wait import collect
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


def map_on_ray(session: RaySession, ds, function, *, cache_file_name: str, new_fingerprint: str,
               desc: str | None = None, progress: bool = True, **map_kwargs):
    """``ds.map(function, ...)`` (batched) on the actors of ``session``: see the module docstring.
    ``ds`` must be file-backed (``thdpack.offline.inputs.mmap_input.memory_mapped``). Returns the
    concatenated ``datasets.Dataset``; ``with_indices=True`` gives ``function`` indices in ``ds``."""
    import datasets
    from tqdm.auto import tqdm

    if not map_kwargs.get("batched"):
        raise ValueError("map_on_ray: pass batched=True (it maps batches)")
    ray = import_ray()
    parts = num_parts(len(ds), session.actors, map_kwargs.get("batch_size") or 1000)
    bounds = part_bounds(len(ds), parts)
    shared = [ray.put(ds), ray.put(function), ray.put(map_kwargs)]  # a list: the actor gets the refs, not copies
    mapper = ray.remote(num_cpus=session.options.cpus_per_actor, max_restarts=-1, max_task_retries=-1)(_PartMapper)
    actors = [mapper.remote(cache_file_name, new_fingerprint, parts) for _ in range(min(session.actors, parts))]
    bar = tqdm(total=len(ds), desc=f"{desc or 'Map'} (ray, {len(actors)} actors)", unit=" examples",
               disable=not progress)
    try:
        collect(actors, [(r, lambda actor, r=r: actor.map_part.remote(shared, r, *bounds[r])) for r in range(parts)],
                on_done=lambda r, rows: bar.update(rows))
    finally:
        bar.close()
        for actor in actors:
            ray.kill(actor, no_restart=True)
    return datasets.concatenate_datasets(
        [datasets.Dataset.from_file(part_file(cache_file_name, r, parts)) for r in range(parts)])


class _PartMapper:
    """A Ray actor mapping parts of the shared rows with the shared row tokenizer."""

    def __init__(self, cache_file_name: str, new_fingerprint: str, parts: int):
        import datasets

        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one CPU per actor: no thread pool of Rust tokenizers
        datasets.disable_progress_bars()
        self.cache_file_name, self.new_fingerprint, self.parts = cache_file_name, new_fingerprint, parts
        self.ds = self.function = self.map_kwargs = None

    def map_part(self, shared: list, r: int, start: int, stop: int) -> int:
        """Map rows ``[start, stop)`` (part ``r``) into its part file; the rows mapped. ``shared``: the refs
        of the rows, the function and the map's arguments, fetched at the actor's first part (a list, so
        that Ray passes the refs, not their values: an actor's restart then needs no constructor object)."""
        import ray

        if self.ds is None:
            self.ds, self.function, self.map_kwargs = ray.get(shared)
        part = self.ds.shard(num_shards=self.parts, index=r, contiguous=True)
        assert len(part) == stop - start, (r, len(part), start, stop)
        fn = _Shifted(self.function, start) if self.map_kwargs.get("with_indices") else self.function
        part.map(fn, **dict(self.map_kwargs, cache_file_name=part_file(self.cache_file_name, r, self.parts),
                            new_fingerprint=f"{self.new_fingerprint}_{r:05d}_of_{self.parts:05d}"))
        return stop - start


class _Shifted:
    """The map function with the rows' indices shifted from the part to the whole dataset."""

    def __init__(self, function, offset: int):
        self.function, self.offset = function, offset

    def __call__(self, batch, indices):
        return self.function(batch, [i + self.offset for i in indices])
