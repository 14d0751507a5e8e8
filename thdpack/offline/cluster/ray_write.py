"""The pack-writing step on Ray: one Ray task per data file.

:class:`~thdpack.offline.store.writer.PackFiles` (the plan, the output order, the file cuts and the
tokenized rows as their file paths) is put in the object store once; task ``s`` writes data file
``s`` into the build's temporary directory exactly as the local loop does, and returns its
``files`` entry (name, packs, tokens, bytes, SHA-256) and its target tokens. A task whose worker
dies is run again (up to ``ray_max_retries`` times, :func:`~thdpack.offline.cluster.ray_tasks.run_tasks`); it
rewrites its file from the start.
"""

from __future__ import annotations

from pathlib import Path

from thdpack.offline.cluster.ray_session import RaySession
from thdpack.offline.cluster.ray_tasks import run_tasks


def write_on_ray(session: RaySession, files, out_dir: Path, *, progress: bool = True) -> dict:
    """Write every data file of ``files`` (a :class:`~thdpack.offline.store.writer.PackFiles`) into
    ``out_dir`` on the cluster of ``session``; :func:`~thdpack.offline.store.writer.write_packs`'s result."""
    from tqdm.auto import tqdm

    bar = tqdm(total=int(files.order.size), desc=f"Writing packs (ray, {files.num_files} files)", unit="pack",
               disable=not progress, leave=False)
    try:
        written = run_tasks(session, _write_file, files, [(str(out_dir), s) for s in range(files.num_files)],
                            on_done=lambda s, result: bar.update(result[0]["num_packs"]),
                            describe=lambda s: f"writing {files.describe(s)}")
    finally:
        bar.close()
    return files.result(written)


def _write_file(files, out_dir: str, s: int):
    """A Ray task: write data file ``s`` of ``files`` into ``out_dir``."""
    return files.write(Path(out_dir), s)
