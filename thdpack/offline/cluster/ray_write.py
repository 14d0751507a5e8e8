"""The pack-writing step on Ray: one Ray task per data file.

:class:`~thdpack.offline.store.writer.PackFiles` (the plan, the output order, the file cuts and the
tokenized rows as their file paths) is put in the object store once; task ``s`` writes data file
``s`` into the build's temporary directory exactly as the local loop does, and returns its
``files`` entry (name, packs, tokens, bytes, SHA-256) and its target tokens. A task whose worker
dies is run again (``max_retries``); it rewrites its file from the start.
"""

from __future__ import annotations

from pathlib import Path

from thdpack.offline.cluster.ray_session import RaySession, import_ray
from thdpack.offline.cluster.ray_wait import collect_tasks

MAX_RETRIES = 5  # a data file's task, run again when its worker dies (not on an exception of its own)


def write_on_ray(session: RaySession, files, out_dir: Path, *, progress: bool = True) -> dict:
    """Write every data file of ``files`` (a :class:`~thdpack.offline.store.writer.PackFiles`) into
    ``out_dir`` on the cluster of ``session``; :func:`~thdpack.offline.store.writer.write_packs`'s result."""
    from tqdm.auto import tqdm

    ray = import_ray()
    task = ray.remote(num_cpus=session.options.cpus_per_actor, max_retries=MAX_RETRIES)(_write_file)
    files_ref = ray.put(files)
    refs = {task.remote(files_ref, str(out_dir), s): s for s in range(files.num_files)}
    written: list = [None] * files.num_files
    bar = tqdm(total=int(files.order.size), desc=f"Writing packs (ray, {files.num_files} files)", unit="pack",
               disable=not progress, leave=False)

    def done(s, result):
        written[s] = result
        bar.update(result[0]["num_packs"])

    try:
        collect_tasks(refs, on_done=done)
    except BaseException:
        _cancel_unfinished(ray, refs)
        raise
    finally:
        bar.close()
    return files.result(written)


def _cancel_unfinished(ray, refs) -> None:
    """Cancel the writing tasks still running (the build stops: an error, a signal). Only those not
    finished, and without ``force``: Ray 2.60's driver aborts (``Check failed: ... Tried to complete task
    that was not pending``) when a force-cancel races the reply of a task that has just finished."""
    done, running = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    for ref in running:
        ray.cancel(ref, force=False)


def _write_file(files, out_dir: str, s: int):
    """A Ray task: write data file ``s`` of ``files`` into ``out_dir``."""
    return files.write(Path(out_dir), s)
