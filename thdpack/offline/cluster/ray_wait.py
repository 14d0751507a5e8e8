"""Waiting on Ray work from the driver: in steps of :data:`POLL_S` in Ray's code, each followed by a
checkpoint of ours (:func:`~thdpack.offline.procs.check_signals`), so that Ctrl-C and SIGTERM are acted on
within a fraction of a second; a worker's exception is raised as it was raised there.

A piece of work whose worker is lost (killed, out of memory, its node gone) is run again by the caller,
counted here (:class:`Retries`): once more than ``ray_max_retries`` times stops the build with one line
naming what it was working on. Ray's own retries are off (``max_restarts=0``, ``max_retries=0``), so that
the count is of the piece of work, whatever worker it ran on.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from thdpack.offline.errors import OfflineError
from thdpack.offline.procs import check_signals

POLL_S = 0.2  # how long the driver waits in Ray's code at a time
logger = logging.getLogger(__name__)


class RayWorkerLost(OfflineError):
    """A piece of the build whose worker was lost more often than ``ray_max_retries`` allows."""


class _Lost(Exception):
    """A worker was lost while running a piece of work (``str``: Ray's first line of why)."""


class Retries:
    """Counts the lost workers of each piece of work (``key``); past ``limit`` losses of one piece,
    :class:`RayWorkerLost` naming it (``describe(key)``)."""

    def __init__(self, limit: int, describe: Callable[[object], str]):
        self.limit, self.describe, self.lost = limit, describe, {}

    def count(self, key, why: str) -> None:
        """Count a lost worker of ``key``: log it and return (run it again), or raise past the limit."""
        n = self.lost[key] = self.lost.get(key, 0) + 1
        if n > self.limit:
            raise RayWorkerLost(f"ray: {self.describe(key)}: its worker was lost {n} time{'s' * (n > 1)} (ray_max_retries "
                                f"{self.limit}), last: {why}; the build stops (nothing is written)")
        logger.warning(f"ray: {self.describe(key)}: its worker was lost ({why}); running it again "
                       f"({n} of {self.limit})")


def collect(actors: list, work: list[tuple[object, Callable]], *, on_done: Callable, retries: Retries,
            replace: Callable) -> None:
    """Run ``work`` (``(key, submit)`` pairs; ``submit(actor)`` returns an ``ObjectRef``) on ``actors``,
    one item per actor at a time, each idle actor taking the next item; ``on_done(key, result)`` as each
    finishes (in any order). A worker's exception is raised here (:func:`result_of`); an item whose actor
    died is counted by ``retries`` and run again first, on ``replace(actor)`` (a new actor)."""
    import ray

    queue = deque(work)
    pending: dict = {}

    def submit(actor, item=None):
        key, fn = item or queue.popleft()
        pending[fn(actor)] = (key, fn, actor)

    for actor in actors:
        if queue:
            submit(actor)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        check_signals()
        for ref in ready:
            key, fn, actor = pending.pop(ref)
            try:
                result = result_of(ref)
            except _Lost as lost:
                retries.count(key, str(lost))
                submit(replace(actor), (key, fn))
                continue
            on_done(key, result)
            if queue:
                submit(actor)


def collect_tasks(refs: dict, *, on_done: Callable, retries: Retries, resubmit: Callable) -> None:
    """Wait for Ray tasks ``refs`` (``{ObjectRef: key}``); ``on_done(key, result)`` as each finishes. A task
    whose worker was lost is counted by ``retries`` and run again (``resubmit(key)`` -> its new ``ObjectRef``)."""
    import ray

    pending = refs
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        check_signals()
        for ref in ready:
            key = pending.pop(ref)
            try:
                result = result_of(ref)
            except _Lost as lost:
                retries.count(key, str(lost))
                pending[resubmit(key)] = key
                continue
            on_done(key, result)


def result_of(ref):
    """``ray.get(ref)``, raising a worker's exception as its own type and message (not Ray's wrapper, whose
    message holds the remote traceback); a lost worker (actor died, worker crashed or killed for memory, node
    or object lost) as :class:`_Lost`."""
    import ray
    from ray import exceptions as rex

    try:
        return ray.get(ref)
    except rex.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise
    except (rex.ActorDiedError, rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError,
            rex.OutOfMemoryError) as exc:
        text = str(exc).strip()
        raise _Lost(text.splitlines()[0] if text else type(exc).__name__) from None
