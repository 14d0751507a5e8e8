"""Independent pieces of work as Ray tasks: :func:`run_tasks`, one task per item, each run again when its
worker is lost (up to ``ray_max_retries`` times, then the build stops with a line naming the item), waited on
in steps of our own code (:mod:`~thdpack.offline.cluster.ray_wait`), the unfinished ones cancelled when the
build stops."""

from __future__ import annotations

from typing import Callable

from thdpack.offline.cluster.ray_session import RaySession, import_ray
from thdpack.offline.cluster.ray_wait import Retries, collect_tasks


def run_tasks(session: RaySession, function: Callable, shared, items: list, *, on_done: Callable | None = None,
              describe: Callable[[int], str] | None = None) -> list:
    """``[function(shared, *item) for item in items]``, each call a Ray task on the cluster of ``session``.
    ``shared`` is put in the object store once (every task reads the same copy); each item is a tuple of
    the task's other arguments. ``on_done(k, result)`` is called as item ``k`` finishes (in any order);
    the results come back in the order of ``items``. A task's exception is raised here as its own; a task
    whose worker is lost more than ``ray_max_retries`` times raises
    :class:`~thdpack.offline.cluster.ray_wait.RayWorkerLost` naming it (``describe(k)``, e.g. the data file)."""
    ray = import_ray()
    task = ray.remote(num_cpus=session.options.cpus_per_actor, max_retries=0)(function)
    shared_ref = ray.put(shared)
    refs = {task.remote(shared_ref, *item): k for k, item in enumerate(items)}
    results: list = [None] * len(items)
    name = getattr(function, "__name__", "a task")
    retries = Retries(session.options.max_retries, describe or (lambda k: f"{name} {k + 1} of {len(items)}"))

    def done(k, result):
        results[k] = result
        if on_done is not None:
            on_done(k, result)

    try:
        collect_tasks(refs, on_done=done, retries=retries, resubmit=lambda k: task.remote(shared_ref, *items[k]))
    except BaseException:
        _cancel_unfinished(ray, refs)
        raise
    return results


def _cancel_unfinished(ray, refs) -> None:
    """Cancel the tasks still running (the build stops: an error, a signal). Only those not finished, and
    without ``force``: Ray 2.60's driver aborts (``Check failed: ... Tried to complete task that was not
    pending``) when a force-cancel races the reply of a task that has just finished."""
    if not refs:
        return
    done, running = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    for ref in running:
        ray.cancel(ref, force=False)
