"""Megatron-Bridge's and Megatron-core's own code for tests, without their training stack.

``bridge_site()`` unpacks the wheels of megatron-bridge 0.6.2 and megatron-core 0.19.2
(``pip download --no-deps``, about 5 MB, cached under ``~/.cache/thdpack``) into a directory
of plain Python files. Both declare ``Requires-Python >= 3.12``, but the modules the tests
import (Bridge's packed-Parquet reader and its ``collate_fn``; megatron-core's
``PackedSeqParams``) are plain Python that 3.11 runs; they are imported in a subprocess
(``tests/megatron_run.py``) so that nothing leaks into the test process.

Where the wheels cannot be had (no package index), ``bridge_site()`` returns the reason
instead of a path. A test of their code then skips, and says so in its id: ``peer_param`` gives
its one parameter, ``megatron-bridge-0.6.2`` where the code is here and
``megatron-bridge-0.6.2-missing`` (skipped, with the reason) where it is not. A test that checks
thdpack against a written specification runs everywhere, as a test of its own.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

import pytest

BRIDGE = "megatron-bridge==0.6.2"
CORE = "megatron-core==0.19.2"
CACHE = Path(os.environ.get("THDPACK_CACHE", Path.home() / ".cache" / "thdpack")) / "megatron-bridge-0.6.2-core-0.19.2"
RUNNER = Path(__file__).with_name("megatron_run.py")
SITE_ID = "megatron-bridge-0.6.2"
CORE_ID = "megatron-core-0.19.2"
FAILURE_NOTE = ".failed"  # a failed download, read by the other xdist workers that start with it
FAILURE_FRESH_S = 120.0


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
        failed = pip_download(CACHE, cmd, f"{BRIDGE} {CORE}")
        if failed:
            return failed
        tmp = CACHE / "site.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(tmp)
        os.replace(tmp, site)
    return site


def pip_download(cache: Path, cmd: list[str], what: str) -> str | None:
    """Run ``cmd`` (a ``pip download``; the caller holds ``cache``'s lock): None, or why it failed.

    A failure is noted in ``cache`` for ``FAILURE_FRESH_S`` seconds, and a caller within them gets the
    same answer without trying again: the xdist workers of one run, which collect their tests while
    the first of them downloads, then collect the same test ids (a parameter's id says whether the
    code is here)."""
    note = cache / f"{FAILURE_NOTE}-{re.sub(r'[^A-Za-z0-9.=_-]+', '_', what)}"
    if note.is_file() and time.time() - note.stat().st_mtime < FAILURE_FRESH_S:
        return note.read_text()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        failed = f"`pip download {what}` took more than 300 s"
    else:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        failed = f"`pip download {what}` failed: {last}" if done.returncode else None
    if failed:
        note.write_text(failed)
    return failed


@functools.lru_cache(maxsize=None)
def site_or_reason() -> Path | str:
    """``bridge_site()``, asked once per test process."""
    return bridge_site()


def peer_param(found, name: str, *before):
    """The ``pytest.param`` of a test of a peer's own code: ``*before`` then ``found`` (the code, or a
    path to it) with id ``name``; or, where ``found`` is the reason it cannot be had (a string), a
    skipped one with id ``{name}-missing`` and that reason."""
    if isinstance(found, str):
        return pytest.param(*before, None, id=f"{name}-missing", marks=pytest.mark.skip(reason=f"{name}: {found}"))
    return pytest.param(*before, found, id=name)


def site_param(name: str = SITE_ID):
    """:func:`peer_param` of the unpacked wheels (``name``: what the test runs of them)."""
    return peer_param(site_or_reason(), name)


def packed_seq_params_module(site: Path) -> types.ModuleType:
    """megatron-core 0.19.2's own ``megatron/core/packed_seq_params.py``, loaded from ``site`` alone (it
    imports torch only; megatron-core's package ``__init__`` imports its whole training stack)."""
    path = site / "megatron" / "core" / "packed_seq_params.py"
    spec = importlib.util.spec_from_file_location("megatron.core.packed_seq_params", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def core_params_or_reason() -> types.ModuleType | str:
    """:func:`packed_seq_params_module`, loaded once per test process, or why it cannot be had."""
    site = site_or_reason()
    return site if isinstance(site, str) else packed_seq_params_module(site)


def packed_seq_params_params() -> list:
    """Both answers of ``megatron.core.packed_seq_params`` for a test of ``to_packed_seq_params``, as
    parameters for :func:`import_packed_seq_params`: ``None`` (id ``no-megatron-core``: not importable)
    and megatron-core 0.19.2's module (id ``megatron-core-0.19.2``, or skipped where it cannot be had)."""
    return [pytest.param(None, id="no-megatron-core"), peer_param(core_params_or_reason(), CORE_ID)]


def import_packed_seq_params(monkeypatch, module: types.ModuleType | None) -> None:
    """Make ``from megatron.core.packed_seq_params import PackedSeqParams`` give ``module``'s, or raise
    ImportError (``module`` None), until ``monkeypatch`` undoes it, whatever is installed."""
    if module is None:
        monkeypatch.setitem(sys.modules, "megatron.core.packed_seq_params", None)  # None: ImportError
        return
    for name in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "megatron.core.packed_seq_params", module)


def field(params, name: str):
    """Field ``name`` of what ``to_packed_seq_params`` gave: a dict, or a ``PackedSeqParams``."""
    return params[name] if isinstance(params, dict) else getattr(params, name)


def run(site: Path, tasks: list[dict], timeout: float = 120) -> list:
    """Run ``tasks`` (see ``tests/megatron_run.py``) with Bridge's code from ``site``, in one
    subprocess; their JSON answers."""
    env = dict(os.environ, PYTHONPATH=str(site), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(RUNNER)], input=json.dumps(tasks), capture_output=True, text=True,
                          timeout=timeout, env=env)
    if done.returncode:
        raise AssertionError(f"tests/megatron_run.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
