"""A build's rows from its sources to its plan, top to bottom: read -> tokenize -> select -> blend -> plan.

Every build is a mixture of one or more sources (:attr:`~thdpack.offline.stages.BuildStages.sources`). A plain
build (``input``: a path, a list of paths, ``{demo: ...}``) is one source, planned as it is; ``input`` as a list of
sources is blended by the sources' weights before the plan (:mod:`~thdpack.offline.commands.mixture_build`). Each
source is read and tokenized by its own options, into its own work directory, and its bad and too long rows are
found the same way, whatever the number of sources. The commands call :func:`prepare_stages` (``build`` writes
what it returns, ``stats`` counts it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from thdpack.offline.commands import sample_plan as sp
from thdpack.offline.commands.mixture_build import SourceRows, blend_and_plan
from thdpack.offline.errors import ConfigError, InputError, require_hf
from thdpack.offline.inputs.sources import Source, read_source
from thdpack.offline.stages import BuildStages, SourceStages
from thdpack.offline.tokenizing.row_formats import row_format
from thdpack.offline.tokenizing.tokenize_step import resolve_format, tokenize_source
from thdpack.offline.vision.vlm_setup import vlm_build

logger = logging.getLogger("thdpack.offline.commands.build_packs")  # the build's stage lines, as before


def prepare_stages(stages: BuildStages, work_dir: Path, *, progress: bool = True, input_slice=None,
                   ray_session=None) -> sp.Prepared:
    """Read, tokenize, select, blend and plan the build resolved into ``stages`` (tokenized rows are memory-mapped
    from ``work_dir``); each step is handed only its own options. ``input_slice`` (a
    :class:`thdpack.offline.inputs.input_slice.InputSlice`): only that slice's rows; ``ray_session``: read and
    tokenize on that Ray cluster (``engine: ray``)."""
    require_hf("thdpack build")
    if stages.mixture is not None and input_slice is not None:
        raise ConfigError("--slice is not available for a mixture: the blend needs every source's kept rows; build "
                          "in one process (num_proc: N, or engine: ray, parallelises the tokenizing)")
    timings = {}
    t0 = time.perf_counter()
    reads = [_read(i, spec, stages, work_dir, progress, ray_session, input_slice)  # 1. read
             for i, spec in enumerate(stages.sources)]
    timings["read"] = time.perf_counter() - t0
    _check_share_prefix(stages, reads)
    rows = [_tokenize(r, stages, progress, ray_session) for r in reads]  # 2. tokenize, 3. select
    timings["tokenize"] = time.perf_counter() - t0 - timings["read"]
    t0 = time.perf_counter()
    if stages.mixture is None:  # 4. plan the one source as it is
        prep = _plan(rows[0], stages, input_slice, ray_session)
    else:  # 4. blend the sources, plan the blend
        prep = blend_and_plan(rows, stages, ray_session)
    timings["plan"] = time.perf_counter() - t0
    sp.log_plan(stages.planning, prep.plan, prep.without_targets, timings["plan"])
    prep.timings.update(timings)
    return prep


@dataclass(frozen=True)
class _SourceRead:
    """One source read (not yet tokenized): its row format resolved, its VLM set-up (rows with images, else None)
    and its work directory."""

    spec: SourceStages
    source: Source
    fmt: str
    work: Path
    vlm: object

    @property
    def pairs(self) -> bool:
        """Preference rows: a chosen and a rejected sequence per row."""
        return row_format(self.fmt).sequences_per_row > 1


@contextlib.contextmanager
def _named(name: str | None):
    """A ConfigError / InputError raised inside, as the same error naming mixture source ``name`` (None: as it is)."""
    try:
        yield
    except (ConfigError, InputError) as exc:
        if name is None:
            raise
        raise type(exc)(f"mixture source {name!r}: {exc}") from None


def _read(i: int, spec: SourceStages, stages: BuildStages, work_dir: Path, progress: bool, ray_session,
          input_slice) -> _SourceRead:
    """Source ``i`` read (its files fetched into its work directory: ``work_dir``, or ``work_dir/source-i`` in a
    mixture; on the cluster with ``ray_session``), sliced (``input_slice``) and its format resolved; the options
    its rows cannot take refused before anything is tokenized."""
    planning, mixed = stages.planning, stages.mixture is not None
    work = work_dir / f"source-{i:03d}" if mixed else work_dir
    work.mkdir(exist_ok=not mixed)
    t0 = time.perf_counter()
    with _named(spec.name if mixed else None):
        if ray_session is None:
            source = read_source(spec.inputs, progress=progress, fetch_dir=work / "inputs")
        else:  # the rows are read where they are, by Ray tasks (thdpack/offline/inputs/cluster_source.py)
            from thdpack.offline.inputs.cluster_source import read_on_cluster

            source = read_on_cluster(ray_session, spec.inputs, progress=progress, fetch_dir=work / "inputs")
        if source.num_rows == 0:
            raise InputError("no rows" if mixed else
                             f"{source.files[0].path if source.files else spec.inputs.input}: no rows")
        if not mixed:
            logger.info(f"read      {source.num_rows:,} rows from {len(source.files)} input(s) in "
                        f"{time.perf_counter() - t0:.1f}s")
        if input_slice is not None:  # tokenize and plan only this slice's rows (thdpack/offline/inputs/input_slice.py)
            source = input_slice.select(source)
        fmt = resolve_format(spec.tokenize, source)
        pairs = row_format(fmt).sequences_per_row > 1
        if pairs or planning.group_column:  # a pair, a group: in one pack (and one unit of a blend)
            sp.check_group_options(planning, input_slice,
                                   "preference rows (prompt / chosen / rejected)" if pairs else "group_column")
            if mixed and stages.mixture.packing == "stratified":  # before tokenizing: plan_stratified takes no groups
                raise ConfigError("mixture_packing stratified cannot keep preference pairs or group_column groups "
                                  "together yet: use bfd")
        vlm = vlm_build(stages.vision, stages.model_config, source)  # rows with images (vision/vlm_setup.py)
        if mixed and vlm is not None:
            raise ConfigError("rows with images cannot be mixed yet: build this source on its own")
    return _SourceRead(spec, source, fmt, work, vlm)


def _check_share_prefix(stages: BuildStages, reads: list[_SourceRead]) -> None:
    """ConfigError for ``share_prefix`` over rows with images, or where no source has groups to share within
    (preference rows or ``group_column``)."""
    planning = stages.planning
    if not planning.share_prefix:
        return
    if any(r.vlm is not None for r in reads):
        raise ConfigError("share_prefix: rows with images are not shared (a shared image prompt's mRoPE rows are not "
                          "built); remove share_prefix")
    if planning.group_column or any(r.pairs for r in reads):
        return
    if stages.mixture is None:
        raise ConfigError(f"share_prefix needs preference rows (prompt / chosen / rejected) or group_column; the "
                          f"rows are {reads[0].fmt} rows")
    named = ", ".join(f"{r.spec.name!r} ({r.fmt} rows)" for r in reads)
    raise ConfigError(f"share_prefix needs preference rows (prompt / chosen / rejected) or group_column; no mixture "
                      f"source has them: {named}")


def _tokenize(read: _SourceRead, stages: BuildStages, progress: bool, ray_session) -> SourceRows:
    """The source ``read`` tokenized into its work directory, and its usable rows selected (failed, too long, over
    the vision budget left out and counted)."""
    planning, spec, source, mixed = stages.planning, read.spec, read.source, stages.mixture is not None
    t0 = time.perf_counter()
    with _named(spec.name if mixed else None):
        mapper = None
        if ray_session is not None:
            from thdpack.offline.cluster.ray_map import map_on_ray

            name = (f"source {spec.name!r}" if mixed else
                    " + ".join(f.path for f in source.files[:3]) + " + ..." * (len(source.files) > 3))
            mapper = functools.partial(map_on_ray, ray_session, progress=progress, name=name)
        tokenized = tokenize_source(spec.tokenize, source, read.work, progress=progress, vlm=read.vlm, mapper=mapper)
        if not mixed:
            what = tokenized.fmt + (f", loss on {spec.tokenize.loss}" if tokenized.fmt == "chat" else "")
            logger.info(f"tokenized {source.num_rows:,} rows ({what}): {int(tokenized.lengths.sum()):,} tokens in "
                        f"{time.perf_counter() - t0:.1f}s")
        sequences = sp.sequences_of(tokenized, planning, read.pairs)
        if planning.share_prefix and not (read.pairs or planning.group_column):  # a mixture's source without groups
            planning = dataclasses.replace(planning, share_prefix=False)
        sample_rows, skipped, patches, prefix = sp.select_rows(planning, source, tokenized, sequences, read.vlm,
                                                               ray_session)
    failed = np.unique(sequences.row[[s for s, _ in tokenized.errors]]).size if tokenized.errors else 0
    if mixed:
        logger.info(f"source {spec.name!r}: {source.num_rows:,} rows ({tokenized.fmt}), {len(skipped):,} skipped")
        if stages.planning.share_prefix and prefix is None:
            prefix = np.zeros(tokenized.lengths.size, np.int64)
    return SourceRows(spec.name, source, tokenized, sequences, sample_rows, skipped, failed, prefix, patches, read.vlm)


def _plan(rows: SourceRows, stages: BuildStages, input_slice, ray_session) -> sp.Prepared:
    """The plan of one source's selected rows (a plain build)."""
    planning = stages.planning
    planner = sp.Planner(planning, rows.sequences, rows.vlm, rows.patches, rows.prefix)
    count = sp.target_counter(planning.targets, rows.tokenized, ray_session)
    plan, sample_rows, piece_targets, without = sp.plan_samples(planner, count, rows.source, rows.sample_rows,
                                                                whole_input=input_slice is None)
    return sp.Prepared(rows.source, rows.tokenized, plan, sample_rows, rows.skipped, piece_targets, without, {},
                       stages.model_config, rows.vlm, rows.prefix, rows.sequences.group)
