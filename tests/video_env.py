"""A Python environment with torchvision, where transformers' Qwen video processors load, for tests.

The project's own environment has the CPU build of ``torch==2.13.0``, beside which PyPI's
torchvision does not import (``operator torchvision::nms does not exist``), so transformers'
video processors cannot be constructed there. ``video_env()`` makes (once, cached under
``~/.cache/thdpack/video-env``) a virtual environment with ``torch==2.14.1
torchvision==0.29.1`` (the pair pip takes from this machine's disk on Python 3.11 x86_64:
a CUDA build that runs on the CPU, about 5.6 GB), ``av`` and the transformers release of the
test process. Made here in 114 s (2 shared cores); ``tests/video_run.py`` runs in it, in a
subprocess, with this checkout on ``PYTHONPATH``. Where it cannot be made (no such wheels,
no index), ``video_env()`` returns the reason and the tests skip with it; so they do, without
trying, where ``THDPACK_VIDEO_ENV=0`` and it is not made yet. Made again through this module
while the machine ran the full test suite: 645 s.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PINS = ["torch==2.14.1", "torchvision==0.29.1", "av"]
CACHE = Path(os.environ.get("THDPACK_CACHE", Path.home() / ".cache" / "thdpack"))
ENV = CACHE / "video-env"
RUNNER = Path(__file__).with_name("video_run.py")
REPO = Path(__file__).resolve().parents[1]
CREATE_TIMEOUT = 300  # CI stays under its 15 minutes: a slower machine skips, saying so


def _python(env: Path) -> Path:
    return env / "bin" / "python"


def video_env() -> Path | str:
    """The environment's directory (made when missing), or why it cannot be had."""
    import transformers

    if (ENV / ".ready").is_file():
        return ENV
    if os.environ.get("THDPACK_VIDEO_ENV") == "0":
        return f"THDPACK_VIDEO_ENV=0 and {ENV} is not made (unset it to make it: about 2 minutes, 5.6 GB)"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".video-env.lock", "w") as lock:  # pytest-xdist workers: one makes it, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (ENV / ".ready").is_file():
            return ENV
        pins = PINS + [f"transformers=={transformers.__version__}"]
        tmp = CACHE / "video-env.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        base = shutil.which("python3.11") or sys.executable
        for cmd in ([base, "-m", "venv", str(tmp)], [str(_python(tmp)), "-m", "pip", "install", "-q", *pins]):
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=CREATE_TIMEOUT)
            except subprocess.TimeoutExpired:
                return f"`{' '.join(cmd[2:])}` took more than {CREATE_TIMEOUT} s"
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                shutil.rmtree(tmp, ignore_errors=True)
                return f"making the video environment failed (`pip install {' '.join(pins)}`): {last}"
        shutil.rmtree(ENV, ignore_errors=True)
        os.replace(tmp, ENV)  # bin/python finds its pyvenv.cfg beside it: the moved environment works
        (ENV / ".ready").write_text(" ".join(pins) + "\n")
    return ENV


def run(env: Path, tasks: dict, timeout: float = 600) -> dict:
    """Run ``tests/video_run.py`` on ``tasks`` in ``env``; its JSON answer."""
    penv = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([str(_python(env)), str(RUNNER)], input=json.dumps(tasks), capture_output=True, text=True,
                          timeout=timeout, env=penv)
    if done.returncode:
        raise AssertionError(f"tests/video_run.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
