"""A build's worker processes and the signals that stop it, in one place.

``thdpack build --num-proc N`` tokenizes in N processes of its own
(:func:`map_in_processes`: one contiguous part of the rows each, mapped with
``datasets.map`` exactly as ``Dataset.map(num_proc=N)`` would, without its process
pool). Owning the processes is what makes stopping them reliable:

- the workers ignore SIGINT (the main process decides) and die on SIGTERM without
  running Python code; the main process kills them (SIGKILL) whenever it leaves the
  map other than by finishing it: an error, Ctrl-C, a signal (:func:`stop`);
- a worker dies with the main process, even one killed with SIGKILL
  (:func:`die_with_parent`: ``prctl(PR_SET_PDEATHSIG)`` on Linux, a watchdog elsewhere);
- the command line records SIGINT and SIGTERM (:func:`signals_interrupt`) and stops at the
  command's next checkpoint (:func:`check_signals`) with :class:`Interrupted`, which unwinds
  it so that it removes its temporary directory, and exits with ``128 + signal``: 130
  (SIGINT), 143 (SIGTERM); a signal during the rename into place waits for it
  (:func:`signals_deferred`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from thdpack.offline.errors import OfflineError

_INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCHDOG_PERIOD_S = 0.2
_JOIN_TIMEOUT_S = 5.0


class Interrupted(KeyboardInterrupt):
    """The command was stopped by signal ``signum`` (SIGINT or SIGTERM); exit with ``exit_code``.
    ``outcome``: what became of the output, when it is not "nothing was written"."""

    def __init__(self, signum: int, outcome: str | None = None):
        super().__init__(signum)
        self.signum = signum
        self.outcome = outcome

    @property
    def exit_code(self) -> int:
        """``128 + signum``, the shell's code for a process ended by that signal."""
        return 128 + self.signum

    def __str__(self) -> str:
        return f"interrupted by {signal.Signals(self.signum).name}"


_RECORD, _RAISE, _HOLD = "record", "raise", "hold"  # what the handler does with a signal (Listener.mode)


class Listener:
    """The SIGINT / SIGTERM a command has received (:func:`signals_interrupt`), in order.

    The handler records each signal, every one (a repeat is never dropped), and by default
    does nothing else: the command acts on it at a checkpoint it owns (:func:`check_signals`:
    between files, between record batches, before the commit). An exception raised from a
    handler lands wherever the main thread happens to be, inside third-party code that may
    swallow it (pyarrow importing pandas lazily did), so the record, not the exception, is
    what stops the command. Within :func:`signals_raise` (a long step of other libraries,
    with no checkpoint of ours inside) the handler also raises :class:`Interrupted` at once;
    within :func:`signals_held` (the rename into place, the clean-up) it only records.
    ``outcome``: what became of the output once it is in place (:func:`signals_deferred`)."""

    def __init__(self):
        self.received: list[int] = []
        self.mode = _RECORD
        self.outcome: str | None = None

    def interrupted(self) -> Interrupted:
        """The :class:`Interrupted` of the first signal received."""
        return Interrupted(self.received[0], self.outcome)

    def handle(self, signum, frame) -> None:
        self.received.append(signum)
        if self.mode == _RAISE:
            raise Interrupted(signum, self.outcome)


_listener: Listener | None = None  # the innermost signals_interrupt block's


def _listening() -> Listener | None:
    """The listener checkpoints act on: None outside :func:`signals_interrupt` and off the main thread."""
    if _listener is None or threading.current_thread() is not threading.main_thread():
        return None
    return _listener


def check_signals() -> None:
    """A checkpoint: raise :class:`Interrupted` if a SIGINT or SIGTERM has been received (and the
    block is not :func:`signals_held`). Free outside :func:`signals_interrupt` (library use)."""
    listener = _listening()
    if listener is not None and listener.received and listener.mode != _HOLD:
        raise listener.interrupted()


@contextlib.contextmanager
def signals_interrupt():
    """Within the block, SIGINT and SIGTERM are recorded (:class:`Listener`, yielded) and the
    command stops at its next checkpoint with :class:`Interrupted`; one received and not yet acted
    on when the block ends (the output already in place, or another error on its way out) raises
    :class:`Interrupted` there: a command that received a signal never ends as if it had not.
    Handlers someone else installed are left alone, and everything is restored on exit. Outside
    the main thread this does nothing (Python only lets the main thread set handlers)."""
    global _listener
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    listener, outer = Listener(), _listener
    previous = {s: signal.getsignal(s) for s in _INTERRUPT_SIGNALS}
    ours = [s for s, h in previous.items() if h in (signal.SIG_DFL, signal.default_int_handler, None)]

    previous_hook = sys.unraisablehook

    def quiet_interrupted(unraisable) -> None:
        # an Interrupted raised inside a callback from C (numba's compile cache, a ctypes callback) is
        # printed and dropped there; the listener's record still stops the command at its next checkpoint
        if not isinstance(unraisable.exc_value, Interrupted):
            previous_hook(unraisable)

    def restore() -> None:
        global _listener
        for s in ours:
            signal.signal(s, previous[s] if previous[s] is not None else signal.SIG_DFL)
        sys.unraisablehook = previous_hook
        _listener = outer

    _listener = listener
    sys.unraisablehook = quiet_interrupted
    for s in ours:
        signal.signal(s, listener.handle)
    try:
        yield listener
    except BaseException as exc:
        restore()
        if listener.received and not isinstance(exc, Interrupted):
            raise listener.interrupted() from exc
        raise
    restore()
    if listener.received:
        raise listener.interrupted()


@contextlib.contextmanager
def _mode(mode: str):
    """Within the block the handler does ``mode`` with a signal (see :class:`Listener`)."""
    listener = _listening()
    if listener is None:
        yield
        return
    before = listener.mode
    listener.mode = mode
    try:
        yield
    finally:
        listener.mode = before


@contextlib.contextmanager
def signals_raise():
    """A long step of other libraries (reading and tokenizing the input) that holds no checkpoint
    of ours: a signal raises :class:`Interrupted` at once within it, and one that was swallowed
    there is raised as the block ends (a checkpoint on either side)."""
    check_signals()
    with _mode(_RAISE):
        yield
    check_signals()


@contextlib.contextmanager
def signals_held():
    """A step that must run to its end (removing the temporary directory, the rename into place):
    signals are only recorded within it, and acted on at the next checkpoint after it."""
    with _mode(_HOLD):
        yield


@contextlib.contextmanager
def signals_deferred(outcome: str):
    """The commit (moving a finished output into place): a signal received before it stops the
    command here, with nothing moved; one that arrives within it waits for the block to complete,
    then raises :class:`Interrupted` with ``outcome`` (the output is complete and in place).
    ``outcome`` is also what a signal after the block reports (:func:`signals_interrupt`)."""
    check_signals()
    with signals_held():
        yield
    listener = _listening()
    if listener is not None:
        listener.outcome = outcome
    check_signals()


# ---------------------------------------------------------------------------- in a worker


def worker_signals() -> None:
    """In a worker: ignore SIGINT (a terminal's Ctrl-C reaches the whole process group;
    the main process stops the workers) and die on SIGTERM without running Python
    handlers inherited from the main process; then take the signals that
    :func:`_signals_blocked` held back since the fork."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _INTERRUPT_SIGNALS)


def die_with_parent(parent_pid: int) -> None:
    """In a worker: end this process when process ``parent_pid`` (its parent) ends,
    however it ends. Linux: the kernel sends SIGKILL (``PR_SET_PDEATHSIG``); elsewhere a
    daemon thread polls ``os.getppid()``."""
    if not _set_parent_death_signal(signal.SIGKILL):
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="thdpack-parent-watchdog", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)


def _set_parent_death_signal(signum: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signum)``; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    event = threading.Event()
    while not event.wait(_WATCHDOG_PERIOD_S):
        if os.getppid() != parent_pid:
            os._exit(1)


# ---------------------------------------------------------------------------- in the main process


def stop(procs) -> None:
    """Kill (SIGKILL) those of ``procs`` (``multiprocess.Process``) still alive and reap
    them all. Workers hold nothing that needs a clean exit: their output files lie in
    the build's temporary directory."""
    for p in procs:
        if p.exitcode is None:
            with contextlib.suppress(OSError, ValueError, AttributeError):  # AttributeError: never started
                p.kill()
    for p in procs:
        with contextlib.suppress(OSError, ValueError, AssertionError):  # AssertionError: never started
            p.join(_JOIN_TIMEOUT_S)


class WorkerDied(OfflineError):
    """A worker process ended without delivering its part (killed from outside: the OOM
    killer, a signal to that process alone)."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (shown with ``--debug``)."""


def part_file(cache_file_name: str, rank: int, num_parts: int) -> str:
    """``tokenized.arrow`` -> ``tokenized_00001_of_00004.arrow`` (what ``Dataset.map`` names the file of a worker's part)."""
    path = Path(cache_file_name)
    return str(path.with_name(f"{path.stem}_{rank:05d}_of_{num_parts:05d}{path.suffix}"))


def map_in_processes(ds, function, num_proc: int, *, cache_file_name: str, new_fingerprint: str,
                     desc: str | None = None, **map_kwargs):
    """``ds.map(function, num_proc=num_proc, ...)`` in worker processes that this process
    owns: ``ds`` (a ``datasets.Dataset``) is cut into ``num_proc`` contiguous parts (``Dataset.shard``), worker
    ``r`` maps part ``r`` into ``part_file(cache_file_name, r, num_proc)``, and the parts'
    results are concatenated in order: the same rows, files and table as ``Dataset.map``.
    ``with_indices=True`` gives ``function`` the rows' indices in ``ds``, not in the part.

    An exception in a worker is raised here (same type); a worker that dies raises
    :class:`WorkerDied`. Whatever ends the map early (an error, :class:`Interrupted`), no
    worker outlives it (:func:`stop`). Batched maps only (``batched=True``)."""
    import datasets
    import multiprocess
    from datasets.utils import tqdm as hf_tqdm

    if not map_kwargs.get("batched"):
        raise ValueError("map_in_processes: pass batched=True (it maps batches)")
    ctx = multiprocess.get_context()  # the start method Dataset.map's pool uses
    parts = [ds.shard(num_shards=num_proc, index=r, contiguous=True) for r in range(num_proc)]
    offsets = [sum(len(s) for s in parts[:r]) for r in range(num_proc)]
    procs, readers = [], []
    results: list = [None] * num_proc
    try:
        with _tokenizers_parallelism_off():
            for r, part in enumerate(parts):
                reader, writer = ctx.Pipe(duplex=False)
                kwargs = dict(map_kwargs, cache_file_name=part_file(cache_file_name, r, num_proc),
                              new_fingerprint=f"{new_fingerprint}_{r:05d}_of_{num_proc:05d}")
                p = ctx.Process(target=_map_part, args=(writer, os.getpid(), part, function, offsets[r], kwargs),
                                name=f"thdpack-map-{r}", daemon=True)
                procs.append(p)  # before start(): an interrupt right after the fork still stops it
                readers.append(reader)
                with _signals_blocked():
                    p.start()
                writer.close()  # the worker holds the only write end: EOF here when it ends
        with hf_tqdm(unit=" examples", total=len(ds), desc=f"{desc or 'Map'} (num_proc={num_proc})") as bar:
            _collect(procs, readers, results, bar)
    finally:
        with signals_held():  # a repeat signal must not leave a worker unreaped
            stop(procs)
            for reader in readers:
                reader.close()
    return datasets.concatenate_datasets(results)


def _collect(procs, readers, results: list, bar) -> None:
    """Receive the workers' messages until every part is in ``results``."""
    from multiprocess.connection import wait

    waiting = dict(zip(readers, range(len(readers))))
    while waiting:
        check_signals()
        for reader in wait(list(waiting), _WATCHDOG_PERIOD_S):  # a checkpoint at least this often
            r = waiting[reader]
            try:
                kind, value, *extra = reader.recv()
            except (EOFError, OSError):
                procs[r].join(_JOIN_TIMEOUT_S)
                check_signals()  # a signal to the process group ends the workers too: report the signal
                raise WorkerDied(
                    f"tokenizing worker {r} (pid {procs[r].pid}) ended without its result ({_how(procs[r].exitcode)}); "
                    "if it ran out of memory, lower --num-proc or --map-batch-size"
                ) from None
            if kind == "progress":
                bar.update(value)
            elif kind == "done":
                results[r] = value
                del waiting[reader]
            else:  # "error": the worker's exception, and its traceback as text
                raise value from RemoteTraceback(extra[0])


def _how(exitcode) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


@contextlib.contextmanager
def _signals_blocked():
    """Hold SIGINT and SIGTERM back in this thread, and so in a child it forks until the
    child has set its own handlers (:func:`worker_signals`): a child must never run the
    main process's handlers. Signals that arrive meanwhile are delivered afterwards."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _INTERRUPT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextlib.contextmanager
def _tokenizers_parallelism_off():
    """As ``Dataset.map(num_proc=...)`` does: Rust tokenizers' threads do not survive a fork."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


class _Reporting:
    """The map function as a worker runs it: indices shifted from the part to the whole
    dataset, and each batch's row count sent to the main process (its progress bar)."""

    def __init__(self, function, offset: int, conn):
        self.function, self.offset, self.conn = function, offset, conn

    def __call__(self, batch, indices=None):
        if indices is None:
            out = self.function(batch)
        else:
            out = self.function(batch, [i + self.offset for i in indices])
        self.conn.send(("progress", _num_rows(batch)))
        return out


def _num_rows(batch) -> int:
    """Rows of a batch: a ``pyarrow.Table`` or a dict of columns."""
    if hasattr(batch, "num_rows"):
        return batch.num_rows
    return len(next(iter(batch.values()))) if batch else 0


def _map_part(conn, parent_pid: int, part, function, offset: int, map_kwargs: dict) -> None:
    """A worker's whole life: map one part and send ("done", dataset) or ("error", exc, traceback)."""
    die_with_parent(parent_pid)
    worker_signals()
    import datasets

    datasets.disable_progress_bars()  # the main process shows one bar for all workers
    try:
        out = part.map(_Reporting(function, offset, conn), **map_kwargs)
        conn.send(("done", out))
    except Exception as exc:  # noqa: BLE001 - raised again in the main process
        text = traceback.format_exc()
        try:
            conn.send(("error", exc, text))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}"), text))
    finally:
        conn.close()
