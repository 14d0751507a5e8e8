"""Signals and process faults of a real ``thdpack build --num-proc 2`` (thdpack/offline/procs.py).

The process tests start the build in a new session, wait until its two tokenizing
workers exist, signal it (or kill one of its processes), and check: it ends within
10 s with 128 + signal (2 for a killed worker), says so in one line, leaves no
temporary directory and no process of the build alive. Then, in this process: a
signal while the output is moved into place, and ``map_in_processes`` itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402

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
