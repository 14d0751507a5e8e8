"""Staged output of an offline command (build, merge, Bridge export): lock the output,
check it may be written, fill a hidden temporary directory next to it, then commit
(metadata last, fsync, atomic rename); the directory is removed on failure.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path

from thdpack.offline.errors import OfflineError, OutputError, OutputExistsError, read_error
from thdpack.offline.store.schema import METADATA_FILE, PackedMetadata, metadata_text
from thdpack.offline.procs import check_signals, signals_deferred, signals_held

logger = logging.getLogger(__name__)


class OutputLock:
    """An exclusive ``flock`` on ``.NAME.lock`` next to ``output``, taken before the existence check
    and released after the rename: of two builds (or merges) of one output started together, the
    second fails at once with :class:`OutputError` instead of replacing the first's output.
    The lock file is removed on release; a holder re-checks that the file it locked is still
    the one at the path (another holder may have removed it in between).

    Not ``filelock`` (installed with datasets): measured with its 4.3.1, it leaves the lock file
    next to the output after release, and on a file system without locks (ENOLCK) it raises
    where a build must go on; removing the file ourselves would need this re-check anyway."""

    def __init__(self, output: Path):
        self.path = output.parent / f".{output.name}.lock"
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputError(
                    f"output {output} is being written by another thdpack process (it holds {self.path}); "
                    "wait for it to finish, or choose another --output"
                ) from None
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    os.close(fd)
                    raise
                self.fd = fd  # a file system without locks (some network mounts): the rename still never merges
                return
            if _same_file(fd, self.path):
                self.fd = fd
                return
            os.close(fd)  # locked a lock file that its holder has just removed: take the new one

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked: nobody can be holding it
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # flock errors of file systems that have none


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return os.path.samestat(os.fstat(fd), st)


def start_output(output: Path, overwrite: bool, *, marker: str = METADATA_FILE) -> tuple[Path, OutputLock]:
    """Lock ``output``, check that it may be written (:func:`_check_output`) and make the hidden
    temporary directory ``.NAME.tmp-PID-RAND`` next to it that :func:`commit_staged` moves into place.
    ``marker``: the file that marks an earlier output of the same command, which ``overwrite`` may replace.
    Returns ``(tmp, lock)``; the caller removes ``tmp`` on failure and releases the lock when done."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        lock = OutputLock(output)
    except OSError as exc:
        if not is_file_system_error(exc):
            raise
        raise output_error(exc, output) from exc
    try:
        _check_output(output, overwrite, marker)
        # listed, not globbed: the output's name may hold * ? [
        stale = sorted(p for p in output.parent.iterdir() if p.name.startswith(f".{output.name}.tmp-"))
        if stale:
            logger.info(f"note: {len(stale)} leftover temporary dir(s) of interrupted builds next to the output "
                f"(e.g. {stale[0]}); they are not datasets and can be deleted")
        tmp = output.parent / f".{output.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
    except BaseException as exc:
        lock.release()
        if is_file_system_error(exc):
            raise output_error(exc, output) from exc
        raise
    return tmp, lock


@contextmanager
def staged_output(output: Path, overwrite: bool, *, marker: str = METADATA_FILE):
    """The hidden temporary directory a writer fills, under the output lock (:func:`start_output`).

    The writer ends by moving it into place (:func:`commit_staged`, or :func:`move_into_place` within
    :func:`~thdpack.offline.procs.signals_deferred`). On any exception the directory is removed and a
    file-system failure becomes one line naming the path (:func:`file_error`: a file it could not
    read, or the output it could not write); the lock is released in every case.
    """
    with signals_held():  # a signal here is acted on at the writer's first checkpoint, after the try
        tmp, lock = start_output(output, overwrite, marker=marker)
    try:
        yield tmp
    except BaseException as exc:
        with signals_held():
            shutil.rmtree(tmp, ignore_errors=True)
        if is_file_system_error(exc):
            raise file_error(exc, output, tmp) from exc
        raise
    finally:
        with signals_held():
            lock.release()


def is_file_system_error(exc: BaseException) -> bool:
    """An ``OSError`` from the file system (not one of thdpack's own errors, some of which are OSErrors)."""
    return isinstance(exc, OSError) and not isinstance(exc, OfflineError)


_OS_HINTS = {
    errno.ENOSPC: "the disk is full: free space there or choose another --output",
    errno.EDQUOT: "the disk quota is exceeded: free space there or choose another --output",
    errno.EROFS: "the file system is read-only: choose another --output",
    errno.EACCES: "no permission to write there: choose another --output or fix the permissions",
    errno.EPERM: "no permission to write there: choose another --output or fix the permissions",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another --output",
    errno.EEXIST: "a part of the path is a file, not a directory: choose another --output",
}


_WRITE_ONLY = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # failures only a write meets


def file_error(exc: OSError, output: Path, tmp: Path | None = None) -> OfflineError:
    """One line for a file-system failure of a command writing ``output`` (from ``tmp``): a path of
    its own (``output``, ``tmp``, the lock, their parent directories) or a failure only writes meet is
    :func:`output_error`; any other path is an input the command could not read
    (:func:`~thdpack.offline.errors.read_error`), not a place it writes."""
    path = exc.filename
    if path is None or exc.errno in _WRITE_ONLY or _own_path(Path(os.fsdecode(path)), output, tmp):
        return output_error(exc, output, tmp)
    if exc.errno in (errno.EACCES, errno.EPERM) and not _unreadable(os.fsdecode(path)):  # a write elsewhere (a cache)
        return output_error(exc, output, tmp)
    return read_error(exc)


def _unreadable(path: str) -> bool:
    """``path`` is there and this process may not read it, or a directory on its way may not be searched
    (checked with the effective ids and capabilities, as ``open`` is); False for a file being created."""
    effective = os.access in os.supports_effective_ids
    if os.path.lexists(path):
        return not os.access(path, os.R_OK, effective_ids=effective)
    return not os.access(os.path.dirname(os.path.abspath(path)), os.X_OK, effective_ids=effective)


def _own_path(path: Path, output: Path, tmp: Path | None) -> bool:
    """``path`` is one the command writes: within ``output`` or ``tmp``, a hidden sibling of the output
    (its lock, its old copy), or a directory on the way to the output (created for it)."""
    path, output = Path(os.path.abspath(path)), Path(os.path.abspath(output))
    ours = [output] + ([Path(os.path.abspath(tmp))] if tmp is not None else [])
    if any(path == o or o in path.parents for o in ours):
        return True
    if path.parent == output.parent and path.name.startswith(f".{output.name}."):
        return True
    return path in output.parents


def output_error(exc: OSError, output: Path, tmp: Path | None = None) -> OutputError:
    """One line for a file-system failure while writing ``output``: the path, the reason, what to do.
    (The temporary directory has already been removed by the caller.)"""
    path = exc.filename if exc.filename is not None else output
    reason = " ".join((exc.strerror or str(exc) or type(exc).__name__).split())  # pyarrow's may span lines
    if tmp is not None:
        path = str(path).replace(str(tmp), str(output) + " (temporary copy)")
    hint = _OS_HINTS.get(exc.errno, "check the path, its permissions and free space")
    return OutputError(f"cannot write {output}: {path}: {reason}; {hint}")


def _check_output(output: Path, overwrite: bool, marker: str = METADATA_FILE) -> None:
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return  # nothing there, or an empty directory: nothing to lose
    if not overwrite:
        raise OutputExistsError(f"output {output} already exists; pass --overwrite to replace it")
    if not output.is_dir():
        raise OutputExistsError(f"output {output} exists and is not a directory; not replacing it")
    if any(output.iterdir()) and not (output / marker).is_file():
        what = "thdpack packed dataset" if marker == METADATA_FILE else "thdpack output"
        raise OutputExistsError(
            f"output {output} exists and is not a {what} (no {marker}); "
            "not replacing it, even with --overwrite. Remove it yourself if it is yours to delete."
        )


def commit_staged(tmp: Path, meta: PackedMetadata, output: Path) -> None:
    """Write ``metadata.json`` last (its presence marks a complete dataset), durably, then
    move the finished ``tmp`` directory to ``output``. A SIGINT/SIGTERM received before the rename
    stops the command with the old output untouched; one arriving during it waits until the
    dataset is in place (never half moved), then stops the command saying so."""
    check_signals()
    meta_tmp = tmp / (METADATA_FILE + ".partial")
    meta_tmp.write_text(metadata_text(meta), encoding="utf-8")
    fsync_file(meta_tmp)
    os.replace(meta_tmp, tmp / METADATA_FILE)
    fsync_dir(tmp)
    with signals_deferred(f"the packed dataset was complete and is at {output}"):
        move_into_place(tmp, output)


def move_into_place(tmp: Path, output: Path) -> None:
    """Rename ``tmp`` to ``output`` (under the :class:`OutputLock`). A directory already at ``output``
    (empty, or a thdpack dataset under --overwrite: checked by :func:`_check_output`) is moved aside
    first and removed after; the rename itself never merges two directories: it fails if something
    new appeared at ``output``, and the old dataset is then put back."""
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(output, old)
    try:
        os.rename(tmp, output)
    except BaseException:
        if old is not None:
            os.rename(old, output)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(output.parent)


def fsync_file(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to disk: every file an offline command
    writes is synced before the directory is renamed into place."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """:func:`fsync_file` of a directory, where the file system can sync one."""
    try:
        fsync_file(path)
    except OSError:  # some filesystems cannot fsync a directory
        pass
