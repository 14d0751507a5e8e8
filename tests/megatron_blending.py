"""Megatron-core's blending rule for tests: a plain-Python port of it, and megatron-core's own compiled helper
where it can run.

megatron-core 0.19.2 blends datasets in C++ (``megatron/core/datasets/helpers.cpp``, compiled into the
wheel's ``helpers_cpp.cpython-312-x86_64-linux-gnu.so``): ``BlendedDataset._build_indices`` calls
``build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size, verbose)`` with the
weights normalised (``megatron.core.datasets.utils.normalize``) when the blend has a size, and
``build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, num_datasets)`` when it has
none (every dataset gives exactly ``sizes[i]`` samples). Both are one greedy rule: sample ``t`` comes from the
dataset whose deficit ``weights[i] · max(t, 1) − drawn[i]`` is largest (the first such dataset on ties;
the exhaustive variant only among datasets not used up, its weights ``sizes / Σ sizes``).
:func:`blending_indices` and :func:`exhaustive_blending_indices` port that rule line by line.

The helper is a CPython 3.12 extension (the wheel requires 3.12), so the test process (3.11 here) cannot
import it. :func:`run_helper` runs it in a Python 3.12 interpreter found on the machine, with the wheel's
``.so`` and a numpy wheel for 3.12 (``pip download``, cached next to the megatron wheels by
``tests/megatron_env.py``) on its path; where that cannot be had, :func:`helper_python` says why and the
tests that compare the port with the helper skip, while the tests of thdpack against the port still run.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from megatron_env import CACHE, bridge_site

NUMPY = "numpy==2.2.6"  # a wheel for CPython 3.12, for the helper's interpreter only
HELPER = "megatron/core/datasets/helpers_cpp.cpython-312-x86_64-linux-gnu.so"


def blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``build_blending_indices`` (helpers.cpp): ``(dataset_index, dataset_sample_index)``, ``[size]`` each."""
    w = np.asarray(weights, np.float64)
    w = w / w.sum()  # megatron.core.datasets.utils.normalize, applied by BlendedDataset when size is given
    current = np.zeros(w.size, np.int64)
    dataset_index = np.zeros(size, np.int64)
    sample_index = np.zeros(size, np.int64)
    for t in range(size):
        error = w * max(float(t), 1.0) - current
        i = int(np.argmax(error))  # the first maximum: the C++ loop replaces only on a strictly larger error
        dataset_index[t], sample_index[t] = i, current[i]
        current[i] += 1
    return dataset_index, sample_index


def exhaustive_blending_indices(sizes) -> tuple[np.ndarray, np.ndarray]:
    """``build_exhaustive_blending_indices`` (helpers.cpp): every dataset ``i`` exactly ``sizes[i]`` times."""
    sizes = np.asarray(sizes, np.int64)
    w = sizes / float(sizes.sum())
    current = np.zeros(sizes.size, np.int64)
    unspent = [i for i in range(sizes.size)]  # std::set<int32_t>: iterated in increasing order
    dataset_index, sample_index = [], []
    t = 0
    while unspent:
        best, best_error = -1, -np.inf
        for i in unspent:
            error = w[i] * max(float(t), 1.0) - current[i]
            if error > best_error:
                best, best_error = i, error
        dataset_index.append(best)
        sample_index.append(current[best])
        current[best] += 1
        if sizes[best] - current[best] == 0:
            unspent.remove(best)
        t += 1
    return np.array(dataset_index, np.int64), np.array(sample_index, np.int64)


_SCRIPT = r"""
import json, sys
import numpy as np
import helpers_cpp
out = []
for task in json.load(sys.stdin):
    if task["kind"] == "blend":
        w = np.array(task["weights"], np.float64)
        w = w / w.sum()
        di, si = np.zeros(task["size"], np.int16), np.zeros(task["size"], np.int64)
        helpers_cpp.build_blending_indices(di, si, w, len(w), task["size"], False)
    else:
        sizes = np.array(task["sizes"], np.int64)
        di, si = np.zeros(int(sizes.sum()), np.int16), np.zeros(int(sizes.sum()), np.int64)
        helpers_cpp.build_exhaustive_blending_indices(di, si, sizes, len(sizes))
    out.append([di.astype(np.int64).tolist(), si.tolist()])
print(json.dumps(out))
"""


def helper_python() -> tuple[str, dict] | str:
    """``(python, env)`` that import megatron-core's compiled helper as ``helpers_cpp``, or why not."""
    site = bridge_site()
    if isinstance(site, str):
        return site
    python = _python312()
    if python is None:
        return "no Python 3.12 interpreter on this machine (megatron-core's compiled helper is built for CPython 3.12)"
    numpy_site = _numpy312(python)
    if isinstance(numpy_site, str):
        return numpy_site
    helper_dir = CACHE / "blending-helper"
    if not (helper_dir / Path(HELPER).name).is_file():
        helper_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(site / HELPER, helper_dir / Path(HELPER).name)
    env = dict(os.environ, PYTHONPATH=f"{numpy_site}{os.pathsep}{helper_dir}", PYTHONNOUSERSITE="1")
    env.pop("PYTHONHOME", None)
    return python, env


def run_helper(python: str, env: dict, tasks: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
    """megatron-core's helper on ``tasks`` (``{"kind": "blend", "weights", "size"}`` or ``{"kind":
    "exhaustive", "sizes"}``): ``(dataset_index, dataset_sample_index)`` of each."""
    done = subprocess.run([python, "-c", _SCRIPT], input=json.dumps(tasks), capture_output=True, text=True,
                          timeout=120, env=env)
    if done.returncode:
        raise AssertionError(f"megatron-core's blending helper failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [(np.array(d, np.int64), np.array(s, np.int64)) for d, s in json.loads(done.stdout)]


def _python312() -> str | None:
    """A working CPython 3.12 (``python3.12`` on PATH, or a pyenv one), or None."""
    pyenv = os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")
    found = [shutil.which("python3.12")] + sorted(glob.glob(pyenv))
    if sys.version_info[:2] == (3, 12):
        found.insert(0, sys.executable)
    for python in filter(None, found):
        try:
            done = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == "True":
            return python
    return None


def _numpy312(python: str) -> Path | str:
    """A directory holding numpy for CPython 3.12 (a wheel unpacked, cached), or why it cannot be had."""
    site = CACHE / "numpy-cp312"
    if (site / "numpy" / "__init__.py").is_file():
        return site
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".numpy-lock", "w") as lock:  # pytest-xdist workers: one downloads, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (site / "numpy" / "__init__.py").is_file():
            return site
        wheels = CACHE / "numpy-wheel"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--python-version",
               "3.12", "--dest", str(wheels), NUMPY]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return f"`pip download {NUMPY}` took more than 300 s"
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return f"`pip download {NUMPY}` failed: {last}"
        tmp = CACHE / "numpy-cp312.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for wheel in sorted(wheels.glob("numpy-*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(tmp)
        os.replace(tmp, site)
    return site
