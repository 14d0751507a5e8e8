"""Megatron-Bridge's and Megatron-core's own code for tests, without their training stack.

``bridge_site()`` unpacks the wheels of megatron-bridge 0.6.2 and megatron-core 0.19.2
(``pip download --no-deps``, about 5 MB, cached under ``~/.cache/thdpack``) into a directory
of plain Python files. Both declare ``Requires-Python >= 3.12``, but the modules the tests
import (Bridge's packed-Parquet reader and its ``collate_fn``; megatron-core's
``PackedSeqParams``) are plain Python that 3.11 runs; they are imported in a subprocess
(``tests/megatron_run.py``) so that nothing leaks into the test process.

Where the wheels cannot be had (no package index), ``bridge_site()`` returns the reason
instead of a path, and the tests say so and check a written specification instead.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

BRIDGE = "megatron-bridge==0.6.2"
CORE = "megatron-core==0.19.2"
CACHE = Path(os.environ.get("THDPACK_CACHE", Path.home() / ".cache" / "thdpack")) / "megatron-bridge-0.6.2-core-0.19.2"
RUNNER = Path(__file__).with_name("megatron_run.py")


def bridge_site() -> Path | str:
    """The directory holding the unpacked ``megatron`` package, or why it cannot be had."""
    site = CACHE / "site"
    if (site / "megatron" / "bridge" / "data" / "packing" / "parquet.py").is_file():
        return site
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:  # pytest-xdist workers: one downloads, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (site / "megatron").is_dir():
            return site
        wheels = CACHE / "wheels"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--python-version",
               "3.12", "--dest", str(wheels), BRIDGE, CORE]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return f"`pip download {BRIDGE} {CORE}` took more than 300 s"
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return f"`pip download {BRIDGE} {CORE}` failed: {last}"
        tmp = CACHE / "site.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(tmp)
        os.replace(tmp, site)
    return site


def run(site: Path, tasks: list[dict], timeout: float = 120) -> list:
    """Run ``tasks`` (see ``tests/megatron_run.py``) with Bridge's code from ``site``, in one
    subprocess; their JSON answers."""
    env = dict(os.environ, PYTHONPATH=str(site), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(RUNNER)], input=json.dumps(tasks), capture_output=True, text=True,
                          timeout=timeout, env=env)
    if done.returncode:
        raise AssertionError(f"tests/megatron_run.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
