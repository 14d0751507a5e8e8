"""``engine: ray`` on a real cluster joined by address: a Ray head started as a separate process
(``ray start --head --block``), a build run by the ``thdpack`` command with ``--ray-address`` pointing at it.

The build's bytes are the local build's (a slice of a JSON Lines file read in byte ranges, Megatron-Bridge
output: the counting, tokenizing, pack-writing and conversion tasks run on the cluster), the cluster is still up after the build (a build never shuts down a cluster it did not
start), and the head is ended by its process id, leaving no process of it behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR  # noqa: E402
from thdpack.offline.cluster.ray_session import LOCAL_SYSTEM_CONFIG  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")  # with the other Ray tests: one Ray at a time on the machine

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> str:
    """The ``ray`` command of this interpreter's environment."""
    path = Path(sys.executable).with_name("ray")
    return str(path) if path.exists() else "ray"


def _tree(pid: int) -> list:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(proc) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def ray_head():
    """A Ray head node, 2 CPUs, started as its own process (``ray start --head --block``); yields
    ``(address, process)``; ended by its process id (SIGTERM, then SIGKILL of what is left) at the end.
    Its session directory is a short one of its own (Ray's socket paths must stay under 108 bytes). Its workers
    run at the driver's priority (``worker_niceness`` 0, as a build's own local instance's do): at Ray's default
    (+15) they would wait on every process of the other test worker sharing the cores."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    temp = tempfile.mkdtemp(prefix="thdpack-ray-")
    head = subprocess.Popen(
        [_ray_cli(), "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={temp}", f"--system-config={json.dumps(LOCAL_SYSTEM_CONFIG)}",
         "--block"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    address = f"127.0.0.1:{port}"
    seen: set = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and head.poll() is None:
            seen |= set(_tree(head.pid))
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                if any("raylet" in " ".join(p.cmdline()) for p in seen if _alive(p)):
                    break
            except (OSError, psutil.Error):
                pass
            time.sleep(0.2)
        assert head.poll() is None, f"ray start --head ended: {head.stderr.read()[-2000:]}"
        time.sleep(2)  # the raylet registers with the GCS
        yield address, head
    finally:
        seen |= set(_tree(head.pid))
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        end = time.monotonic() + 30
        while time.monotonic() < end and any(_alive(p) for p in seen):
            time.sleep(0.2)
        left = [p for p in seen if _alive(p)]
        for p in left:
            p.kill()
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"processes of the Ray head outlived it: {[p.pid for p in left]}"


def _digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _build_on(address: str, flags: list[str], out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "thdpack", "build", *flags, "--output", str(out), "-q",
                           "--engine", "ray", "--ray-address", address],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_build_joins_a_cluster_by_address_and_leaves_it_running(ray_head, tmp_path):
    """A slice (1/2) of a JSON Lines file read in byte ranges by the cluster's tasks (blank lines between rows),
    written as Megatron-Bridge packs: the local slice build's bytes."""
    from thdpack.demo import generate_rows

    address, head = ray_head
    data = tmp_path / "rows.jsonl"
    lines = [json.dumps(r) for r in generate_rows(600, seed=7, kind="chat")]
    data.write_text("".join(line + ("\n\n" if k % 29 == 3 else "\n") for k, line in enumerate(lines)))
    assert data.stat().st_size > 3 * (1 << 16)  # several byte ranges
    flags = ["--input", str(data), "--tokenizer", str(TOKENIZER_DIR), "--pack-size", "1024", "--overflow", "split",
             "--output-format", "megatron-bridge", "--slice", "1/2"]
    assert main(["build", *flags, "--output", str(tmp_path / "local"), "-q"]) == 0
    proc = _build_on(address, flags, tmp_path / "ray")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _digest(tmp_path / "ray") == _digest(tmp_path / "local")
    # the cluster it joined is still up: the head process and every process under it (GCS, raylet, ...), its port
    processes = _tree(head.pid)
    assert head.poll() is None and all(_alive(p) for p in processes), [p.pid for p in processes if not _alive(p)]
    assert any("gcs_server" in " ".join(p.cmdline()) for p in processes)
    assert any("raylet" in " ".join(p.cmdline()) for p in processes)
    socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])), timeout=5).close()
