"""The ``thdpack`` command under faults (issue 11, sections 1 and 3): ``--help`` of every
sub-command, ``--version``, a closed stdout pipe, file-system failures at the output (a path
under a file, no permission, a full disk), the summary printed once, progress bars kept out of
log files, and two builds (or a build and a merge) of the same output at the same time."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from thdpack import __version__  # noqa: E402
from thdpack.cli import main  # noqa: E402
from thdpack.offline import load_packed  # noqa: E402
from thdpack.offline.errors import OutputError  # noqa: E402
from thdpack.offline.commands.slice_merge import merge_slices  # noqa: E402
from thdpack.offline.store.staging import OutputLock  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
SUBCOMMANDS = ("build", "stats", "inspect", "merge")
SMALL = ["--config", str(DEMO), "--max-rows", "60", "--pack-size", "2048"]


def _thdpack(*args) -> list[str]:
    """The console script installed next to this interpreter (``thdpack ...``)."""
    script = Path(sys.executable).with_name("thdpack")
    if not script.exists():
        pytest.skip("the thdpack console script is not installed next to this interpreter")
    return [str(script), *map(str, args)]


def _module(*args) -> list[str]:
    """``python -m thdpack ...``."""
    return [sys.executable, "-m", "thdpack", *map(str, args)]


def _error_line(err: str, command: str) -> str:
    """The single stderr line of a failed command, checked to be one ``error:`` line and no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"thdpack {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _leftovers(parent: Path, name: str) -> list[Path]:
    """Temporary, aside and lock entries of output ``name`` left in ``parent``."""
    return sorted(parent.glob(f".{name}.*"))


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "small"
    assert main(["build", *SMALL, "--output", str(out), "-q"]) == 0
    return out


# ---------------------------------------------------------------------------- help, version, pipes


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_help_of_every_subcommand(sub, capsys):
    with pytest.raises(SystemExit) as stop:
        main([sub, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: thdpack {sub}")
    if sub == "build":  # the help text holding a literal % that argparse used to format
        assert "{% generation %}" in out and "--chat-template" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"thdpack {__version__}"


def test_help_through_both_entry_points():
    """The console script and ``python -m thdpack`` (the parser itself: every sub-command, above)."""
    commands = [_thdpack("build", "--help"), _module("build", "--help")]
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    for c, p in zip(commands, procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and err == "", (c, err)
        assert out.startswith("usage: thdpack build") and "{% generation %}" in out


def test_stdout_closed_by_its_reader_exits_quietly(packed):
    """``thdpack stats out --json | head -1``: the reader is gone before the output is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the pipe now fails with EPIPE, as after head exits
    try:
        proc = subprocess.run(_module("stats", packed, "--json"), cwd=ROOT, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == 128 + 13  # what a Unix tool killed by SIGPIPE reports


# ---------------------------------------------------------------------------- output printed once, readable logs


def test_build_prints_one_line_and_stats_the_block(tmp_path, capsys):
    """``thdpack build ... && thdpack stats OUT`` (the README's main command) shows the block once."""
    out = tmp_path / "again"
    assert main(["build", *SMALL, "--output", str(out)]) == 0
    built = capsys.readouterr().out
    meta = load_packed(out).metadata
    assert built.splitlines() == [f"{out}: {meta['num_packs']} packs, efficiency {meta['stats']['efficiency']:.4f}; "
                                  f"statistics: thdpack stats {out}"]
    assert main(["stats", str(out)]) == 0
    assert capsys.readouterr().out.count("\nefficiency ") == 1


def test_progress_bars_stay_out_of_logs(tmp_path, capsys):
    """stderr is not a terminal (a log file): stage lines, one per line, no bars redrawn with \\r."""
    assert main(["build", *SMALL, "--output", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    stages = [line.split()[0] for line in err.splitlines()]
    assert {"read", "tokenized", "planned", "wrote"} <= set(stages), err


# ---------------------------------------------------------------------------- file-system failures


def test_output_under_a_regular_file(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = blocker / "sub" / "out"
    assert main(["build", *SMALL, "--output", str(out), "-q"]) == 2
    line = _error_line(capsys.readouterr().err, "build")
    assert f"cannot write {out}: {blocker}" in line and "choose another --output" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sysfs is Linux's")
def test_output_where_not_even_root_may_create_it(tmp_path, capsys):
    """sysfs refuses ``mkdir`` at its top (EPERM), root included: a real permission error."""
    parent = Path("/sys") / f"thdpack-test-{os.getpid()}"
    try:
        parent.mkdir()
    except OSError:
        pass
    else:
        parent.rmdir()
        pytest.skip("this system lets us create directories in /sys")
    out = parent / "out"
    assert main(["build", *SMALL, "--output", str(out), "-q"]) == 2
    line = _error_line(capsys.readouterr().err, "build")
    assert f"cannot write {out}: {parent}: " in line and "permission" in line


def test_disk_full_while_writing_removes_the_temporary_directory(tmp_path, capsys, monkeypatch):
    """The disk fills up while the data files are synced (``fsync`` -> ENOSPC)."""
    real_fsync = os.fsync

    def full(fd):
        path = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else "?"
        if path.endswith(".arrow"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "out"
    assert main(["build", *SMALL, "--output", str(out), "-q"]) == 2
    line = _error_line(capsys.readouterr().err, "build")
    assert f"cannot write {out}: {out} (temporary copy)/data-00000-of-00001.arrow: No space left on device" in line
    assert "free space" in line
    assert list(tmp_path.iterdir()) == []  # no output, no temporary directory, no lock file


# Runs in a private mount namespace on a 400 kB tmpfs: a build that fills it, then the same
# file system remounted read-only. Prints what each build returned and left behind.
ON_TMPFS = """
import contextlib, io, json, os, subprocess, sys
from thdpack.cli import main
mnt, config = sys.argv[1], sys.argv[2]
results = {}
for case in ("full", "read-only"):
    if case == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["build", "--config", config, "--max-rows", "300", "--output", os.path.join(mnt, "out"), "-q"])
    results[case] = {"rc": rc, "err": err.getvalue(), "left": sorted(os.listdir(mnt))}
print(json.dumps(results))
"""


def test_full_and_read_only_file_systems(tmp_path):
    """Real faults where the machine allows a private mount namespace (root, unshare): no monkeypatching."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = f"mount -t tmpfs -o size=400k tmpfs {mnt} && exec {sys.executable} -c '{ON_TMPFS}' {mnt} {DEMO}"
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=4k tmpfs {mnt}"], capture_output=True).returncode:
        pytest.skip("no private mount namespace here (needs root and unshare)")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    out = mnt / "out"
    full, ro = results["full"], results["read-only"]
    assert full["rc"] == 2 and ro["rc"] == 2, results
    line = _error_line(full["err"], "build")
    assert line.startswith(f"thdpack build: error: cannot write {out}: ") and "No space left on device" in line
    assert full["left"] == []  # the temporary directory and the lock file are gone
    line = _error_line(ro["err"], "build")
    assert line.startswith(f"thdpack build: error: cannot write {out}: ") and "read-only" in line


def test_failed_rename_puts_the_previous_dataset_back(packed, tmp_path, capsys, monkeypatch):
    """--overwrite moves the old dataset aside; if the final rename fails the old one returns."""
    out = tmp_path / "out"
    shutil.copytree(packed, out)
    before = sorted(p.name for p in out.iterdir())
    real_rename = os.rename

    def failing(src, dst):
        if ".tmp-" in str(src):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src), str(dst))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    assert main(["build", *SMALL, "--seed", "1", "--output", str(out), "--overwrite", "-q"]) == 2
    line = _error_line(capsys.readouterr().err, "build")
    assert f"cannot write {out}:" in line and "read-only" in line
    assert sorted(p.name for p in out.iterdir()) == before
    assert load_packed(out, verify=True).metadata["seed"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ---------------------------------------------------------------------------- two writers of one output

# Runs the real command, but waits inside the build (after the output check, before the plan)
# until the file argv[1] exists: the test lets both processes reach that point before either
# writes, the overlap that made both exit 0 and the second replace the first.
GATED = """
import os, sys, time
import thdpack.offline.commands.build_packs as b
real = b.prepare
def gated(*a, **k):
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.02)
    return real(*a, **k)
b.prepare = gated
from thdpack.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _two_gated_builds(tmp_path: Path, out: Path, extra: list[list[str]]) -> list[tuple[int, str]]:
    """Start two gated builds of ``out`` together; release them once both are waiting inside the
    build or one has already stopped. Returns ``[(exit code, stderr)]``."""
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", GATED, str(go), "build", *SMALL, *e, "--output", str(out), "-q"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for e in extra]
    deadline = time.time() + 120
    while time.time() < deadline:
        waiting = list(out.parent.glob(f".{out.name}.tmp-*"))
        if len(waiting) == 2 or any(p.poll() is not None for p in procs):  # both inside, or one refused
            break
        time.sleep(0.05)
    go.touch()
    results = [(p.wait(timeout=120), p.communicate()[1]) for p in procs]
    go.unlink()
    return results


def test_two_builds_of_one_output_exactly_one_wins(tmp_path):
    out = tmp_path / "x"
    results = _two_gated_builds(tmp_path, out, [["--seed", "1"], ["--seed", "2"]])
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, err in results if rc == 2)
    line = _error_line(loser, "build")
    assert f"output {out} is being written by another thdpack process" in line
    winner_seed = 1 if results[0][0] == 0 else 2
    assert load_packed(out, verify=True).metadata["seed"] == winner_seed
    assert _leftovers(tmp_path, "x") == []


def test_two_overwriting_builds_leave_one_complete_build(packed, tmp_path):
    out = tmp_path / "x"
    shutil.copytree(packed, out)
    results = _two_gated_builds(tmp_path, out, [["--seed", "1", "--overwrite"], ["--seed", "2", "--overwrite"]])
    assert sorted(rc for rc, _ in results) == [0, 2], results
    _error_line(next(err for rc, err in results if rc == 2), "build")
    ds = load_packed(out, verify=True)  # every listed file present with its checksum: one build, not a mix
    meta = ds.metadata
    assert meta["seed"] == (1 if results[0][0] == 0 else 2)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["metadata.json", "tokenizer"] + [f["path"] for f in meta["files"]])
    assert _leftovers(tmp_path, "x") == []


def test_file_system_without_locks_still_builds(tmp_path, capsys, monkeypatch):
    """Some network mounts refuse flock (ENOLCK): the build goes on without the lock."""
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "out"
    assert main(["build", *SMALL, "--output", str(out), "-q"]) == 0, capsys.readouterr().err
    assert load_packed(out, verify=True).metadata["num_packs"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_merge_refuses_an_output_being_written(tmp_path, capsys):
    parts = tmp_path / "parts"
    for i in range(2):
        assert main(["build", *SMALL, "--slice", f"{i}/2", "--output", str(parts / "{slice}"), "-q"]) == 0
    out = tmp_path / "full"
    lock = OutputLock(out)  # another writer of the same output holds it
    try:
        with pytest.raises(OutputError, match=f"output {out} is being written by another thdpack process"):
            merge_slices(parts, out)
        assert not out.exists() and not list(tmp_path.glob(".full.tmp-*"))
    finally:
        lock.release()
    assert merge_slices(parts, out).metadata["num_packs"] == len(load_packed(out))
    assert _leftovers(tmp_path, "full") == []
    assert json.loads((out / "metadata.json").read_text())["input_slices"]["count"] == 2
