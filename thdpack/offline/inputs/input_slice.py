"""Input slices: ``thdpack build --slice i/N`` builds one contiguous range of the input rows.

Slice ``i`` of ``N`` takes the contiguous input rows ``[i·R // N, (i+1)·R // N)`` of the
``R`` input rows (after ``max_rows``), in input order: row ranges differ in size by at
most one row, and concatenating the slices in index order gives every row exactly once,
in order. Each slice build reads (and fingerprints) the whole input, then tokenizes and
plans only its rows: its packs never mix rows of two slices (a *slice-local* plan). The
slice is written as a normal packed dataset whose ``sample_index`` holds *global* input
rows and whose ``metadata.json`` has an ``input_slice`` entry (index, count, row range, the
whole input's row count) next to the whole input's ``source`` fingerprint; a small ``slice_input_lengths.npy`` keeps the
lengths of its planned rows so that :func:`thdpack.offline.commands.slice_merge.merge_slices` can
recompute exact statistics. ("Shard" in thdpack means only a context-parallel rank's
part of a batch.)

``--slice auto`` takes ``i/N`` from the environment: ``RANK`` / ``WORLD_SIZE``
(``torchrun``) or ``SLURM_ARRAY_TASK_ID`` / ``SLURM_ARRAY_TASK_COUNT`` (a Slurm job array,
offset by ``SLURM_ARRAY_TASK_MIN``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from thdpack.common.align import check_int
from thdpack.offline.errors import ConfigError, InputError
from thdpack.offline.inputs.sources import row_range
from thdpack.offline.store.schema import bytes_sha256
from thdpack.offline.store.staging import fsync_file

SLICE_KEY = "input_slice"  # metadata.json entry of a slice build
MERGED_KEY = "input_slices"  # metadata.json entry of a merged build
LENGTHS_FILE = "slice_input_lengths.npy"
logger = logging.getLogger(__name__)


def slice_info(meta: dict):
    """The ``input_slice`` entry of a slice build's metadata; None if none."""
    return meta.get(SLICE_KEY)


def slice_rows(total: int, index: int, count: int) -> tuple[int, int]:
    """Row range ``[start, stop)`` of slice ``index`` of ``count`` over ``total`` rows."""
    return index * total // count, (index + 1) * total // count


@dataclass(frozen=True)
class InputSlice:
    """Slice ``index`` of ``count`` of the input rows (``origin`` says where it came from, for messages)."""

    index: int
    count: int
    origin: str = "--slice"

    def __post_init__(self):
        check_int(self.count, f"{self.given_as}: slice count", 1, error=ConfigError)
        check_int(self.index, f"{self.given_as}: slice index", 0, below=self.count, error=ConfigError)

    @property
    def given_as(self) -> str:
        """How the slice was given, for messages: ``--slice``, or ``--slice auto (ORIGIN)``."""
        return "--slice" if self.origin == "--slice" else f"--slice auto ({self.origin})"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def label(self) -> str:
        """``00003-of-00008``: what ``{slice}`` in an output path becomes."""
        return f"{self.index:05d}-of-{self.count:05d}"

    def rows(self, total: int) -> tuple[int, int]:
        return slice_rows(total, self.index, self.count)

    def format_output(self, output: str | os.PathLike) -> str:
        """Expand ``{slice}`` (``00003-of-00008``), ``{index}`` and ``{count}`` in ``output``; any
        other placeholder is a :class:`ConfigError`.

        Without a placeholder the path is used as given, except under ``--slice auto``
        with more than one slice, where every process would write the same directory.
        """
        text = os.fspath(output)
        if "{" not in text:
            if self.origin != "--slice" and self.count > 1:
                raise ConfigError(
                    f"{self.given_as} runs {self.count} slices: put {{slice}} in --output so that each "
                    f"writes its own directory, e.g. --output {text.rstrip('/')}/part-{{slice}}"
                )
            return text
        try:
            return text.format(slice=self.label, index=self.index, count=self.count)
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"--output {text!r}: only {{slice}}, {{index}} and {{count}} may appear in braces ({exc})"
            ) from None

    def select(self, source) -> SliceSource:
        """The rows of this slice of ``source`` (a :class:`~thdpack.offline.inputs.sources.Source`)."""
        total = source.num_rows
        start, stop = self.rows(total)
        if start == stop:
            raise InputError(
                f"slice {self} has no input rows: the input has {total} row(s), so use at most {total} slice(s)"
            )
        logger.info(f"slice     {self}: input rows {start:,}..{stop - 1:,} ({stop - start:,} of {total:,})")
        return SliceSource(source, self, start, stop)


def parse_slice(spec: str | None, environ: Mapping[str, str] | None = None) -> InputSlice | None:
    """``"i/N"`` -> :class:`InputSlice`; ``"auto"`` reads the environment (see :func:`slice_from_env`)."""
    if spec is None:
        return None
    text = str(spec).strip()
    if text.lower() == "auto":
        return slice_from_env(os.environ if environ is None else environ)
    parts = text.split("/")
    try:
        index, count = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        index = count = None
    if index is None or count is None:
        raise ConfigError(f"--slice must be I/N with 0 <= I < N (e.g. 0/8), or auto; got {spec!r}")
    return InputSlice(index, count)  # which checks the range


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"--slice auto: {name}={env[name]!r} is not an integer") from None


def slice_from_env(env: Mapping[str, str]) -> InputSlice:
    """The input slice of this process from ``torchrun`` (``RANK``/``WORLD_SIZE``) or a Slurm job array
    (``SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN`` of ``SLURM_ARRAY_TASK_COUNT``)."""
    found = []
    if "RANK" in env and "WORLD_SIZE" in env:
        found.append(("torchrun RANK/WORLD_SIZE", _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")))
    if "SLURM_ARRAY_TASK_ID" in env:
        if "SLURM_ARRAY_TASK_COUNT" not in env:
            raise ConfigError("--slice auto: SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not; pass --slice I/N")
        task, count = _env_int(env, "SLURM_ARRAY_TASK_ID"), _env_int(env, "SLURM_ARRAY_TASK_COUNT")
        low = _env_int(env, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in env else 0
        step = _env_int(env, "SLURM_ARRAY_TASK_STEP") if "SLURM_ARRAY_TASK_STEP" in env else 1
        high = _env_int(env, "SLURM_ARRAY_TASK_MAX") if "SLURM_ARRAY_TASK_MAX" in env else low + count - 1
        if step != 1 or high - low + 1 != count:
            raise ConfigError(
                f"--slice auto: the Slurm array is not one contiguous range of task ids ({low}-{high}, step {step}, "
                f"{count} tasks); use --array=0-{count - 1}, or pass --slice I/N yourself"
            )
        found.append(("Slurm array SLURM_ARRAY_TASK_ID/COUNT", task - low, count))
    if not found:
        raise ConfigError(
            "--slice auto: found neither torchrun's RANK/WORLD_SIZE nor a Slurm array's "
            "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT; pass --slice I/N"
        )
    several = [f for f in found if f[2] > 1]
    if len(several) > 1:
        raise ConfigError(
            "--slice auto is ambiguous: " + " and ".join(f"{o} say {i}/{n}" for o, i, n in several)
            + "; pass --slice I/N yourself"
        )
    origin, index, count = several[0] if several else found[0]
    return InputSlice(index, count, origin)  # which checks the range


class SliceSource:
    """The rows ``[row_start, row_stop)`` of a :class:`~thdpack.offline.inputs.sources.Source`.

    Behaves as a source of those rows (``dataset``, ``num_rows``) while ``files``,
    ``columns`` and ``fingerprint`` describe the whole input and :meth:`where` names a
    row by its place in the whole input.
    """

    def __init__(self, whole, part: InputSlice, row_start: int, row_stop: int):
        self.whole = whole
        self.slice = part
        self.row_start = int(row_start)
        self.row_stop = int(row_stop)
        if whole.parts is not None:  # rows where they are (engine: ray): the parts of the slice, its first rows
            self.parts, self.dataset = whole.rows_between(self.row_start, self.row_stop)
        else:
            self.parts = None
            self.dataset = row_range(whole.dataset, self.row_start, self.row_stop)

    @property
    def is_json(self) -> bool:
        return self.whole.is_json

    @property
    def num_rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def total_rows(self) -> int:
        return self.whole.num_rows

    def where(self, row: int) -> str:
        return self.whole.where(self.row_start + int(row))

    def __getattr__(self, name):  # files, columns, fingerprint, ...: those of the whole input
        if name == "whole":
            raise AttributeError(name)
        return getattr(self.whole, name)


def record_slice(out_dir: Path, source: SliceSource, input_lengths: np.ndarray) -> dict:
    """Write ``slice_input_lengths.npy`` into ``out_dir`` and return the ``input_slice`` metadata entry."""
    path = Path(out_dir) / LENGTHS_FILE
    np.save(path, np.ascontiguousarray(input_lengths, dtype="<i8"), allow_pickle=False)
    data = path.read_bytes()
    fsync_file(path)
    return {
        "index": source.slice.index,
        "count": source.slice.count,
        "row_start": source.row_start,
        "row_stop": source.row_stop,
        "input_rows": source.total_rows,
        "input_lengths": {"path": LENGTHS_FILE, "num_bytes": len(data), "sha256": bytes_sha256(data)},
    }
