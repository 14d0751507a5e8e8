"""Waiting on Ray work from the driver: in steps of :data:`POLL_S` in Ray's code, each followed by a
checkpoint of ours (:func:`~thdpack.offline.procs.check_signals`), so that Ctrl-C and SIGTERM are acted on
within a fraction of a second; a worker's exception is raised as it was raised there."""

from __future__ import annotations

from collections import deque
from typing import Callable

from thdpack.offline.errors import OfflineError
from thdpack.offline.procs import check_signals

POLL_S = 0.2  # how long the driver waits in Ray's code at a time


class RayWorkerLost(OfflineError):
    """A part of the build could not be run even after Ray's retries (its node is gone)."""


def collect(actors: list, work: list[tuple[object, Callable]], *, on_done: Callable) -> None:
    """Run ``work`` (``(key, submit)`` pairs; ``submit(actor)`` returns an ``ObjectRef``) on ``actors``,
    one item per actor at a time, each idle actor taking the next item; ``on_done(key, result)`` as each
    finishes (in any order). A worker's exception is raised here (:func:`result_of`)."""
    import ray

    queue = deque(work)
    pending: dict = {}

    def submit(actor):
        key, fn = queue.popleft()
        pending[fn(actor)] = (key, actor)

    for actor in actors:
        if queue:
            submit(actor)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        check_signals()
        for ref in ready:
            key, actor = pending.pop(ref)
            on_done(key, result_of(ref))
            if queue:
                submit(actor)


def collect_tasks(refs: dict, *, on_done: Callable) -> None:
    """Wait for Ray tasks ``refs`` (``{ObjectRef: key}``); ``on_done(key, result)`` as each finishes."""
    import ray

    pending = dict(refs)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        check_signals()
        for ref in ready:
            on_done(pending.pop(ref), result_of(ref))


def result_of(ref):
    """``ray.get(ref)``, raising a worker's exception as its own type and message (not Ray's wrapper, whose
    message holds the remote traceback); a lost actor or task as :class:`RayWorkerLost`."""
    import ray
    from ray import exceptions as rex

    try:
        return ray.get(ref)
    except rex.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise
    except (rex.ActorDiedError, rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RayWorkerLost(f"a Ray worker of the build was lost and could not be retried: {first}") from None
