"""Signals and process faults of a real ``thdpack build --num-proc 2`` (thdpack/offline/procs.py).

The process tests start the build in a new session, wait until its two tokenizing
workers exist, signal it (or kill one of its processes), and check: it ends within
10 s with 128 + signal (2 for a killed worker), says so in one line, leaves no
temporary directory and no process of the build alive. Then, in this process: a
signal while the output is moved into place, and ``map_in_processes`` itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline.store.schema import file_sha256  # noqa: E402

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 10.0
NUM_ROWS = 8000
# One batch per worker, tokenized by transformers: a worker is inside a batch for
# seconds, so nothing here passes by waiting for a batch to end.
BATCH_ROWS = NUM_ROWS // 2


@pytest.fixture(scope="module")
def text_jsonl(tmp_path_factory) -> Path:
    """One input for every test: ~17 MB of seeded text rows."""
    rows = generate_rows(2000, seed=3, kind="text")
    return write_jsonl(rows * (NUM_ROWS // len(rows)), tmp_path_factory.mktemp("signals") / "rows.jsonl")


# ---------------------------------------------------------------------------- the process tree, from /proc


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of a live process; None if it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[3])


def build_processes(root: int) -> list[int]:
    """Live processes in ``root``'s session (it was started with start_new_session=True)
    or descended from it, ``root`` itself included."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            table[int(entry)] = st
    found = {pid for pid, (_, sid) in table.items() if sid == root}
    grew = True
    while grew:
        more = {pid for pid, (ppid, _) in table.items() if ppid in found or pid == root} - found
        found |= more
        grew = bool(more)
    return sorted(found)


def wait_until(condition, timeout: float, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(step)
    return condition()


# ---------------------------------------------------------------------------- running a build


@pytest.fixture
def start_build():
    """:func:`_start_build`; whatever the test's outcome, no process of its builds outlives it."""
    started = []

    def start(src: Path, out: Path) -> subprocess.Popen:
        started.append(_start_build(src, out))
        return started[-1]

    yield start
    for proc in started:
        _kill_all(proc)


def _start_build(src: Path, out: Path) -> subprocess.Popen:
    """``thdpack build --num-proc 2 -q`` of ``src`` into ``out``, in its own session; returns
    once its two tokenizing workers are running."""
    cmd = [sys.executable, "-m", "thdpack", "build", "--input", str(src), "--format", "text",
           "--tokenizer", str(TOKENIZER_DIR), "--tokenizer-backend", "hf", "--pack-size", "4096",
           "--overflow", "truncate", "--num-proc", "2", "--map-batch-size", str(BATCH_ROWS), "--output", str(out), "-q"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    if not wait_until(lambda: len(build_processes(proc.pid)) >= 3 or proc.poll() is not None, 60):
        _kill_all(proc)
        pytest.fail("the build never started its two workers")
    if proc.poll() is not None:
        pytest.fail(f"the build ended (code {proc.returncode}) before its workers ran: {proc.communicate()[1]}")
    time.sleep(0.3)  # the workers are tokenizing
    return proc


def _kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the build that is still alive, and reap it."""
    for pid in build_processes(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate(timeout=DEADLINE_S)


def assert_stopped_cleanly(proc: subprocess.Popen, out: Path, code: int, name: str, t0: float) -> None:
    try:
        _, err = proc.communicate(timeout=DEADLINE_S)  # returns once no process holds its stderr: the workers too
    except subprocess.TimeoutExpired:
        pytest.fail(f"the build was still running {DEADLINE_S} s after {name} (processes {build_processes(proc.pid)})")
    elapsed = time.monotonic() - t0
    left = build_processes(proc.pid)
    assert wait_until(lambda: not build_processes(proc.pid), 2.0), f"processes of the build left alive: {left}"
    assert proc.returncode == code, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert f"interrupted by {name}" in lines[0] and "nothing was written" in lines[0], err
    assert list(out.parent.iterdir()) == [], "a temporary directory or an output was left behind"
    assert elapsed < DEADLINE_S, f"took {elapsed:.1f} s"


@needs_proc
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("to", ["main", "group"])
def test_signal_stops_the_build_and_its_workers(start_build, text_jsonl, tmp_path, signum, to):
    out = tmp_path / "o" / "packed"
    out.parent.mkdir()
    proc = start_build(text_jsonl, out)
    t0 = time.monotonic()
    if to == "main":
        os.kill(proc.pid, signum)
    else:
        os.killpg(proc.pid, signum)
    assert_stopped_cleanly(proc, out, 128 + signum, signal.Signals(signum).name, t0)


@needs_proc
def test_workers_exit_when_the_main_process_is_killed(start_build, text_jsonl, tmp_path):
    out = tmp_path / "o" / "packed"
    out.parent.mkdir()
    proc = start_build(text_jsonl, out)
    workers = [pid for pid in build_processes(proc.pid) if pid != proc.pid]
    assert len(workers) >= 2
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=DEADLINE_S)  # not communicate(): the workers hold its stdout and stderr open
    assert wait_until(lambda: not build_processes(proc.pid), DEADLINE_S), (
        f"workers {build_processes(proc.pid)} outlived the main process by {DEADLINE_S} s")
    # they die with it, not when their batch ends and they find no one to send it to
    assert time.monotonic() - t0 < 2.0
    assert not out.exists()  # only the hidden temporary directory is left, as documented


@needs_proc
def test_a_killed_worker_fails_the_build_in_one_line(start_build, text_jsonl, tmp_path):
    """A worker ended from outside (the OOM killer's SIGKILL) fails the build: exit 2, one
    line naming the worker and the signal, and nothing left behind."""
    out = tmp_path / "o" / "packed"
    out.parent.mkdir()
    proc = start_build(text_jsonl, out)
    worker = max(pid for pid in build_processes(proc.pid) if pid != proc.pid)
    t0 = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the build was still running {DEADLINE_S} s after its worker {worker} was killed")
    assert time.monotonic() - t0 < DEADLINE_S
    assert proc.returncode == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"(pid {worker})" in lines[0] and "SIGKILL" in lines[0], err
    assert "--num-proc" in lines[0], err  # what to do about it
    assert wait_until(lambda: not build_processes(proc.pid), 2.0)
    assert list(out.parent.iterdir()) == []


def test_a_signal_while_the_output_is_moved_into_place_loses_nothing(text_jsonl, tmp_path, monkeypatch, capsys):
    """--overwrite moves the old dataset aside, then the new one into place: a SIGTERM
    between the two renames waits for the second, instead of leaving no dataset at the output."""
    from thdpack.cli import main
    from thdpack.offline import load_packed

    out = tmp_path / "packed"
    args = ["build", "--input", str(text_jsonl), "--format", "text", "--tokenizer", str(TOKENIZER_DIR),
            "--pack-size", "4096", "--overflow", "truncate", "--output", str(out), "-q"]
    assert main([*args, "--max-rows", "40"]) == 0
    real_rename = os.rename

    def rename_then_signal(src, dst):
        real_rename(src, dst)
        if Path(src) == out:  # the old dataset was just moved aside
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(os, "rename", rename_then_signal)
    assert main([*args, "--max-rows", "60", "--overwrite"]) == 128 + signal.SIGTERM
    monkeypatch.undo()
    err = capsys.readouterr().err.strip()
    assert "interrupted by SIGTERM; the packed dataset was complete and is at" in err and "\n" not in err, err
    assert load_packed(out).metadata["counts"]["input_rows"] == 60  # the new dataset, complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed"]  # no temporary or old directory left


# ---------------------------------------------------------------------------- recorded, then acted on


def test_a_signal_is_recorded_and_acted_on_at_the_next_checkpoint():
    """The handler records every signal (a repeat too) and raises nothing by itself; the command's
    checkpoint raises Interrupted for the first; the block's end raises it if no checkpoint did."""
    from thdpack.offline.procs import Interrupted, check_signals, signals_interrupt

    with pytest.raises(Interrupted) as info:
        with signals_interrupt() as listener:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handlers have run
            assert listener.received == [signal.SIGTERM, signal.SIGINT]
            check_signals()
            pytest.fail("the checkpoint did not stop the command")
    assert info.value.exit_code == 143 and info.value.outcome is None
    with pytest.raises(Interrupted, match="interrupted by SIGINT"):
        with signals_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # no checkpoint: the end of the block stops it
    check_signals()  # outside signals_interrupt: nothing recorded, nothing raised
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_that_other_code_swallows_still_stops_the_command():
    """Issue 21 point 7's trace: the Interrupted raised inside third-party code (pyarrow importing
    pandas) was swallowed there, and the once-only guard dropped the repeat."""
    from thdpack.offline.procs import Interrupted, check_signals, signals_interrupt, signals_raise

    def swallowing():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        except BaseException:  # noqa: BLE001 - what the third-party code did
            pass

    with pytest.raises(Interrupted):
        with signals_interrupt() as listener:
            with signals_raise():  # the handler raises at once in here...
                swallowing()
                swallowing()  # ... and a repeat too
                assert listener.received == [signal.SIGINT, signal.SIGINT]
            pytest.fail("leaving signals_raise is a checkpoint")
    with pytest.raises(Interrupted):
        with signals_interrupt():
            swallowing()  # by default nothing is raised in other code: the record stops the command
            check_signals()


def test_signals_held_and_deferred():
    """Within signals_held a signal is only recorded; signals_deferred (the rename) stops before its
    block for a signal already received, and after it, with the outcome, for one during it."""
    from thdpack.offline.procs import Interrupted, check_signals, signals_deferred, signals_held, signals_interrupt

    ran = []
    with pytest.raises(Interrupted) as info:
        with signals_interrupt():
            with signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)
                check_signals()  # held: no stop
                ran.append("held")
            with signals_deferred("it is complete"):
                ran.append("renamed")  # never: the signal came before the commit
    assert ran == ["held"] and info.value.outcome is None
    with pytest.raises(Interrupted) as info:
        with signals_interrupt():
            with signals_deferred("it is complete"):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)
                ran.append("renamed")
    assert ran == ["held", "renamed"] and info.value.outcome == "it is complete" and info.value.exit_code == 130


def test_an_error_on_its_way_out_after_a_signal_reports_the_signal():
    from thdpack.offline.errors import OfflineError
    from thdpack.offline.procs import Interrupted, signals_interrupt

    with pytest.raises(Interrupted) as info:
        with signals_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            raise OfflineError("a worker failed as the signal arrived")
    assert isinstance(info.value.__cause__, OfflineError) and info.value.exit_code == 143


def _merge_args(sweeps, out: Path) -> list[str]:
    return ["merge", str(out), *map(str, sweeps["merge"].argv[2:4]), "-q"]


def test_a_signal_before_the_commit_leaves_the_old_output(sweeps, tmp_path, monkeypatch, capsys):
    """With --overwrite: a SIGINT as the merged metadata is written stops the merge before the rename;
    the old dataset stays as it was, the temporary directory is gone."""
    from thdpack.cli import main
    from thdpack.offline.store import staging

    out = tmp_path / "merged"
    shutil.copytree(sweeps["merge"].old_dir, out)
    real = staging.fsync_dir

    def signalled(path):
        real(path)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(staging, "fsync_dir", signalled)
    assert main([*_merge_args(sweeps, out), "--overwrite"]) == 130
    err = capsys.readouterr().err.strip()
    assert err == "thdpack merge: interrupted by SIGINT; nothing was written at the output path", err
    assert snapshot(out) == sweeps["merge"].old
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]


def test_a_signal_after_the_merge_finished_is_reported_with_the_output(sweeps, tmp_path, monkeypatch, capsys):
    """Never exit 0 after a signal: one that arrives once the output is in place (here: as merge_slices
    returns) exits 143, saying the output is complete."""
    from thdpack.cli import main
    from thdpack.offline.commands import slice_merge as merging

    real = merging.merge_slices

    def then_signalled(*args, **kwargs):
        result = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(merging, "merge_slices", then_signalled)
    out = tmp_path / "merged"
    assert main(_merge_args(sweeps, out)) == 143
    err = capsys.readouterr().err.strip()
    assert err == f"thdpack merge: interrupted by SIGTERM; the packed dataset was complete and is at {out}", err
    assert snapshot(out) == sweeps["merge"].new


# ---------------------------------------------------------------------------- map_in_processes itself


def _row_and_index(table, indices):
    """A batched Arrow map function: each row's ``x`` and its index in the whole dataset."""
    import pyarrow as pa

    return pa.table({"x": table.column("x"), "index": pa.array(indices, pa.int64())})


def _fail_on_row_5(table, indices):
    if 5 in indices:
        raise KeyError("row 5")
    return _row_and_index(table, indices)


def test_map_in_processes_equals_dataset_map(tmp_path):
    """Same rows as ``Dataset.map`` in one process, indices of the whole dataset (not the
    part's), one file per part named as ``Dataset.map(num_proc=...)`` names them."""
    import datasets

    from thdpack.offline.procs import map_in_processes

    ds = datasets.Dataset.from_dict({"x": list(range(10))}).with_format("arrow")
    kwargs = dict(batched=True, batch_size=2, with_indices=True, remove_columns=["x"], load_from_cache_file=False)
    want = ds.map(_row_and_index, cache_file_name=str(tmp_path / "one.arrow"), new_fingerprint="one", **kwargs)
    got = map_in_processes(ds, _row_and_index, 3, cache_file_name=str(tmp_path / "t.arrow"), new_fingerprint="t",
                           **kwargs)
    assert got.data.table.to_pydict() == want.data.table.to_pydict() == {"x": list(range(10)), "index": list(range(10))}
    assert sorted(p.name for p in tmp_path.glob("t_*")) == [f"t_{r:05d}_of_00003.arrow" for r in range(3)]


def test_map_in_processes_raises_a_workers_exception(tmp_path):
    import datasets

    from thdpack.offline.procs import RemoteTraceback, map_in_processes

    ds = datasets.Dataset.from_dict({"x": list(range(10))}).with_format("arrow")
    with pytest.raises(KeyError, match="row 5") as info:
        map_in_processes(ds, _fail_on_row_5, 2, cache_file_name=str(tmp_path / "t.arrow"), new_fingerprint="t",
                         batched=True, batch_size=2, with_indices=True, remove_columns=["x"])
    assert isinstance(info.value.__cause__, RemoteTraceback) and "_fail_on_row_5" in str(info.value.__cause__)


def test_a_signal_right_after_the_fork_never_runs_the_main_process_handler(tmp_path, monkeypatch):
    """A worker SIGINTed before it has set its own handlers (a Ctrl-C to the process group
    at that moment) ignores it, as it would later, instead of raising the main process's
    Interrupted and dying."""
    import datasets

    from thdpack.offline import procs

    real = procs.die_with_parent

    def signalled_first(parent_pid):  # runs first thing in the forked worker
        os.kill(os.getpid(), signal.SIGINT)
        real(parent_pid)

    monkeypatch.setattr(procs, "die_with_parent", signalled_first)
    ds = datasets.Dataset.from_dict({"x": list(range(4))}).with_format("arrow")
    with procs.signals_interrupt():
        got = procs.map_in_processes(ds, _row_and_index, 2, cache_file_name=str(tmp_path / "t.arrow"),
                                     new_fingerprint="t", batched=True, with_indices=True, remove_columns=["x"])
    assert got.data.table.column("index").to_pylist() == [0, 1, 2, 3]


# ---------------------------------------------------------------------------- a signal at every moment of a command
#
# A zygote process imports what ``python -m thdpack`` has imported when main() starts (thdpack.cli,
# not pyarrow, datasets or pandas: the first data file a merge reads imports them, the moment that
# once swallowed a signal) and forks one child per trial: the child runs the command (main(), in
# its own process group, as the thdpack program), the zygote signals it ``delay`` seconds after the
# fork (and again ``repeat`` seconds later if it is still running), reaps it and the processes of
# its group, and reports. A fork costs milliseconds where a fresh interpreter costs seconds, so
# one test samples dozens of moments.

ZYGOTE = r"""
import ctypes, json, os, select, signal, sys, time
import thdpack.cli

ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the command's orphaned workers are ours to reap


def reap_group(pgid, deadline):
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    os.killpg(pgid, signal.SIGKILL)
    return False


def trial(req):
    ending, ended = os.pipe()
    waiting, ready = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ending)
        os.close(waiting)
        os.setpgid(0, 0)
        for fd, name in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.argv = ["thdpack", *req["argv"]]
        os.write(ready, b"x")  # Python runs here: the fork is over (a signal before this may be lost in it)
        os.close(ready)
        code = 1
        try:
            code = thdpack.cli.main()  # argv None: as the thdpack program runs it
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
        except KeyboardInterrupt:  # before main listened, as an uncaught Ctrl-C ends Python
            sys.stdout.flush(); sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.stdout.flush(); sys.stderr.flush()
        os.write(ended, b"x")  # from here on a signal may find the process tearing down, and be lost
        os._exit(code)
    os.close(ended)
    os.close(ready)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    os.read(waiting, 1)
    os.close(waiting)
    t0 = time.monotonic()
    sent, status = [], None
    times = [] if req["delay"] is None else [req["delay"]] + ([req["delay"] + req["repeat"]] if req["repeat"] else [])
    while status is None:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:  # ended: signal no more
            status = os.waitpid(pid, 0)[1]
            break
        now = time.monotonic() - t0
        if times and now >= times[0] and not select.select([ending], [], [], 0)[0]:
            times.pop(0)
            (os.killpg if req["group"] else os.kill)(pid, req["signum"])
            sent.append(round(now, 3))
        time.sleep(0.002)
    elapsed = time.monotonic() - t0
    os.close(ending)
    clean = reap_group(pid, time.monotonic() + 5)
    return {"rc": os.waitstatus_to_exitcode(status), "sent": sent, "elapsed": round(elapsed, 3), "group_gone": clean}


for line in sys.stdin:
    print(json.dumps(trial(json.loads(line))), flush=True)
"""


class Zygote:
    """The zygote process (:data:`ZYGOTE`): :meth:`run` one command in a forked child, signalled at ``delay``."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONHASHSEED="0")
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def run(self, argv: list[str], delay: float | None = None, signum: int = signal.SIGINT, group: bool = False,
            repeat: float | None = None) -> dict:
        out, err = self.workdir / "stdout", self.workdir / "stderr"
        req = {"argv": argv, "delay": delay, "signum": int(signum), "group": group, "repeat": repeat,
               "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            pytest.fail(f"the zygote died (code {self.proc.poll()})")
        result = json.loads(line)
        result.update(stdout=out.read_text(), stderr=err.read_text(), signum=int(signum), group=group)
        return result

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


def snapshot(path: Path) -> dict | None:
    """``{relative path: sha256}`` of every file under ``path``; None if there is nothing there."""
    if not path.exists():
        return None
    return {str(p.relative_to(path)): file_sha256(p) for p in sorted(path.rglob("*")) if p.is_file()}


@dataclass
class Sweep:
    """One command signalled at many moments: its arguments, the output it writes, what an
    uninterrupted run writes there (``new``), what lies there before an --overwrite trial (a copy of
    ``old_dir``) and how long an uninterrupted run took."""

    argv: list[str]
    out: Path
    new: dict
    old_dir: Path
    duration: float

    @property
    def old(self) -> dict:
        return snapshot(self.old_dir)

    def trial(self, zygote: Zygote, delay: float, signum: int, group: bool, overwrite: bool,
              repeat: float | None) -> dict:
        """Signal the command ``delay`` s into a run and check what it did (:func:`check_trial`)."""
        shutil.rmtree(self.out.parent, ignore_errors=True)
        self.out.parent.mkdir(parents=True)
        if overwrite:
            shutil.copytree(self.old_dir, self.out)
        argv = self.argv + (["--overwrite"] if overwrite else [])
        r = zygote.run(argv, delay=delay, signum=signum, group=group, repeat=repeat)
        r.update(delay=delay, overwrite=overwrite, left=sorted(p.name for p in self.out.parent.iterdir()),
                 output=snapshot(self.out))
        check_trial(r, self)
        return r

    def sweep(self, zygote: Zygote, trials: int) -> list[dict]:
        """``trials`` trials at evenly spread moments from the start to a little past the end of a run,
        rotating over SIGINT / SIGTERM, process / process group, with / without --overwrite, and a
        repeat of the signal 0.15 s later in every third trial."""
        step = self.duration / (trials - 2)
        results = []
        for i in range(trials):
            results.append(self.trial(zygote, round(i * step, 3), (signal.SIGINT, signal.SIGTERM)[i % 2],
                                      bool(i // 2 % 2), bool(i // 4 % 2), 0.15 if i % 3 == 2 else None))
        assert any(r["rc"] == 128 + r["signum"] and "nothing was written" in r["stderr"] for r in results), results
        return results


def check_trial(r: dict, sweep: Sweep) -> None:
    """What must hold whenever a signal is sent: the command never exits 0 after it; it exits
    128 + signal with one line saying what became of the output (or dies of the signal itself,
    when it came before the command listened or after it had finished); the output is the
    complete new one or the untouched old one (absent without --overwrite), never partial; and
    nothing else is left next to it (temporary directory, lock file, moved-aside old output)."""
    what = f"signal {signal.Signals(r['signum']).name} at {r['sent']} s (delay {r['delay']:.3f}, " \
           f"{'group' if r['group'] else 'process'}, {'--overwrite' if r['overwrite'] else 'new output'}): {r}"
    before = sweep.old if r["overwrite"] else None
    assert r["group_gone"], f"a process of the command outlived it; {what}"
    assert r["left"] == ([sweep.out.name] if r["output"] is not None else []), f"left behind {r['left']}; {what}"
    assert r["output"] in (sweep.new, before), f"a partial or mixed output; {what}"
    if not r["sent"]:  # it had ended before the signal was due
        assert r["rc"] == 0 and r["output"] == sweep.new, what
        return
    name = signal.Signals(r["signum"]).name
    assert r["rc"] != 0, f"exit 0 after a signal; {what}"
    if r["rc"] == -r["signum"]:  # ended by the signal itself: before main() listened, or after it returned
        return
    assert r["rc"] == 128 + r["signum"], what
    lines = [line for line in r["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and f"interrupted by {name}" in lines[0], what
    if "nothing was written" in lines[0]:
        assert r["output"] == before, what
    else:
        assert "was complete and is at" in lines[0] and r["output"] == sweep.new, what


SWEEP_TOKENS = 1_000_000  # per input: slices of ~2 MB; a run's time is mostly the libraries it imports


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory, zygote) -> dict:
    """A tokenized Parquet input (seeded) built as two input slices with two tokenizing workers each,
    and for each command the :class:`Sweep` of an uninterrupted run: merging the slices, exporting the
    merge, building slice 0 again. The old output an --overwrite replaces: slice 0 (merge), slice 1
    (build), an earlier export (export)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("sweep")
    rng = np.random.default_rng(7)
    lens = rng.integers(16, 4000, SWEEP_TOKENS // 2000)
    off = np.zeros(lens.size + 1, np.int32)
    np.cumsum(lens, out=off[1:])
    ids = rng.integers(0, 3000, int(off[-1])).astype(np.int32)
    mask = (rng.random(ids.size) < 0.6).astype(np.int8)
    src = d / "rows.parquet"
    pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(off), pa.array(ids)),
                             "loss_mask": pa.ListArray.from_arrays(pa.array(off), pa.array(mask))}), src)
    build = ["build", "--input", str(src), "--format", "tokenized", "--pack-size", "4096", "--num-proc", "2",
             "--map-batch-size", "100", "-q"]
    slices = [d / "parts" / f"{i:05d}-of-00002" for i in range(2)]
    old_export = d / "old_export"
    old_export.mkdir()
    (old_export / "bridge_metadata.json").write_text("[]\n")  # the marker of an earlier export
    runs = {}
    for i in range(2):
        r = zygote.run([*build, "--slice", f"{i}/2", "--output", str(d / "parts" / "{slice}")])
        assert r["rc"] == 0, r["stderr"]
        runs[f"slice{i}"] = r["elapsed"]
    commands = {  # argv of an output path, the old output an --overwrite replaces, the reference output
        "merge": (lambda out: ["merge", str(out), *map(str, slices), "-q"], slices[0], d / "merged"),
        "export": (lambda out: ["export", str(d / "merged"), "--to", "megatron-bridge", str(out), "-q"], old_export,
                   d / "exported"),
        "build": (lambda out: [*build, "--slice", "0/2", "--output", str(out)], slices[1], slices[0]),
    }
    out = {}
    for name, (argv, old, reference) in commands.items():
        if name != "build":
            r = zygote.run(argv(reference))
            assert r["rc"] == 0, r["stderr"]
            runs[name] = r["elapsed"]
        target = tmp_path_factory.mktemp(name) / "o" / "out"
        out[name] = Sweep(argv(target), target, snapshot(reference), old, runs.get(name, runs["slice0"]))
    return out


@needs_proc
def test_merge_stops_cleanly_whenever_a_signal_comes(zygote, sweeps):
    """Issue 21 point 7: a signal 0.3-0.4 s into a merge (while pyarrow imported pandas) was swallowed, the
    merge exited 0 and wrote its output. Now, at every moment of the run: 128 + signal and the old
    output, or the complete new one (and a line saying so), never exit 0 after the signal."""
    sweeps["merge"].sweep(zygote, 16)


@needs_proc
def test_export_stops_cleanly_whenever_a_signal_comes(zygote, sweeps):
    sweeps["export"].sweep(zygote, 10)


@needs_proc
def test_build_stops_cleanly_whenever_a_signal_comes(zygote, sweeps):
    """With two tokenizing workers (--num-proc 2): none outlives the build, whatever the moment."""
    sweeps["build"].sweep(zygote, 6)


def test_a_row_range_hashes_nothing_a_signal_could_interrupt(monkeypatch):
    """``select(range(...))`` would hash its arguments inside ``datasets``' bare ``except``: a signal landing there
    is swallowed into a second line ("couldn't be hashed properly"). Our row ranges name their own fingerprint."""
    import datasets
    import datasets.fingerprint

    from thdpack.offline.inputs.sources import row_range

    ds = datasets.Dataset.from_dict({"x": list(range(10))})
    hashed = []
    monkeypatch.setattr(datasets.fingerprint.Hasher, "hash", classmethod(lambda cls, value: hashed.append(value)))
    part = row_range(ds, 2, 7)
    assert hashed == []
    assert part["x"] == [2, 3, 4, 5, 6]
    assert part._fingerprint != ds._fingerprint
    assert row_range(ds, 2, 7)._fingerprint == part._fingerprint != row_range(ds, 2, 8)._fingerprint
