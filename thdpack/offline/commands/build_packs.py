"""``thdpack build`` as a function: read -> tokenize -> plan -> write, atomically.

The output is written into a hidden temporary directory next to it
(``.NAME.tmp-PID-RAND``) and renamed into place only once every data file and, last,
``metadata.json`` are written and synced. An interrupted build (Ctrl-C, SIGTERM, an
exception) removes its temporary directory; one killed outright leaves only that
hidden directory, never a directory at the output path, and never one with
``metadata.json`` that :func:`load_packed` would accept. From the existence check to the
rename the build holds a lock on the output (:class:`~thdpack.offline.store.staging.OutputLock`), so a
second build or merge of the same output fails at once; file-system failures become one
:class:`~thdpack.offline.errors.OutputError` line naming the path
(:func:`~thdpack.offline.store.staging.output_error`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from thdpack.common.align import check_bool
from thdpack.offline.commands.shared_prefixes import TrieShares
from thdpack.offline.commands import bridge_export
from thdpack.offline.config import BuildConfig
from thdpack.offline.stage_options import PlanningOptions, StoreOptions
from thdpack.offline.stages import BuildStages
from thdpack.offline.errors import require_hf
from thdpack.offline.store.schema import (FORMAT_NAME, FORMAT_VERSION, SAMPLE_VALUE_PREFIX, TOKENIZER_DIR,
                                          PREFIX_COLUMNS, SOURCE_COLUMN, PackedMetadata, SourceInfo)
from thdpack.offline.commands.model_record import MODEL_CONFIG_FILE, canonical_json, model_info
from thdpack.offline.procs import signals_raise
from thdpack.offline.store.staging import commit_staged, fsync_file, staged_output
from thdpack.offline.commands.pack_stats import nemo_fields
from thdpack.offline.commands.pipeline import prepare_stages
from thdpack.offline.commands.sample_plan import Prepared

logger = logging.getLogger(__name__)


def prepare(cfg: BuildConfig, work_dir: Path, *, progress: bool = True, input_slice=None) -> Prepared:
    """Read, tokenize and plan ``cfg`` (:func:`~thdpack.offline.commands.pipeline.prepare_stages`; tokenized rows
    are memory-mapped from ``work_dir``); with ``input_slice`` only that slice's rows."""
    require_hf("thdpack build")
    return prepare_stages(BuildStages.from_config(cfg), work_dir, progress=progress, input_slice=input_slice)


# ---------------------------------------------------------------------------- build


@dataclass
class BuildResult:
    path: Path
    metadata: PackedMetadata
    timings: dict
    summary: dict


def build_packed(cfg: BuildConfig, output: str | Path, *, overwrite: bool = False, progress: bool = True,
                 input_slice=None) -> BuildResult:
    """Build the packed dataset of ``cfg`` at ``output`` (see the module docstring); with
    ``input_slice`` (a :class:`thdpack.offline.inputs.input_slice.InputSlice`) only that slice of the input rows.
    Where it runs is the config's (``engine``, ``ray``)::

        build_packed(cfg.override(engine="ray", ray=RayOptions(address="auto")), "out/packs")  # a running cluster
        build_packed(cfg.override(engine="ray", ray={"num_cpus": 8}), "out/packs")            # a local Ray instance

    Stage lines go to ``logging.getLogger("thdpack.offline.commands.build_packs")`` (and the stages' own loggers under
    ``"thdpack"``): configure logging to see them."""
    overwrite, progress = check_bool(overwrite, "overwrite"), check_bool(progress, "progress")
    return _build(cfg, Path(output), overwrite, progress, input_slice)


def _build(cfg: BuildConfig, output: Path, overwrite: bool, progress: bool, input_slice) -> BuildResult:
    from thdpack.offline.store.writer import sample_value_arrays

    require_hf("thdpack build")  # import the heavy libraries before touching the file system
    stages = BuildStages.from_config(cfg)  # validated and resolved once; each stage gets its own options
    store = stages.store
    t_start = time.perf_counter()
    with staged_output(output, overwrite) as tmp, _engine(stages) as session:
        work = tmp / "_work"
        work.mkdir()
        with signals_raise():  # reading and tokenizing run in other libraries: a signal stops them at once
            prep = prepare_stages(stages, work, progress=progress, input_slice=input_slice, ray_session=session)
        plan = prep.plan
        if store.output_format == bridge_export.FORMAT:
            bridge_export.check_text_only(prep.vlm)
        t0 = time.perf_counter()
        values = sample_value_arrays(prep.tokenized.dataset.data.table, list(stages.tokenize.value_columns),
                                     prep.sample_rows)
        row_offset = prep.source.row_start if input_slice is not None else 0
        written = _write_pack_files(store, stages.planning, tmp, prep, values, row_offset=row_offset, progress=progress,
                                    ray_session=session)
        tok_info = _save_tokenizer_and_model(store, tmp, prep)
        prep.timings["write"] = time.perf_counter() - t0

        summary = prep.summary()
        summary["target_tokens"] = written["target_tokens"]
        meta = _metadata(stages, prep, summary, written, values, tok_info)
        if store.output_format == bridge_export.FORMAT:  # + Megatron-Bridge's packed Parquet (bridge_export.py)
            meta["megatron_bridge"] = bridge_export.write_build(tmp, stages.planning, written["files"], tok_info,
                                                                run=_bridge_tasks(session))
        if prep.vlm is not None:  # vision columns, image processor copy (thdpack/offline/vision/vlm_setup.py)
            prep.vlm.finish(tmp, meta, prep.tokenized.dataset.data.table, prep.sample_rows[plan.sample_index], plan)
        if input_slice is not None:  # row range + input lengths, for thdpack merge
            from thdpack.offline.inputs.input_slice import SLICE_KEY, record_slice

            meta[SLICE_KEY] = record_slice(tmp, prep.source, prep.tokenized.lengths[prep.sample_rows])
        # release the memory-mapped work files before removing them
        timings = prep.timings
        del prep
        shutil.rmtree(work)
        for f in written["files"]:
            fsync_file(tmp / f["path"])
        commit_staged(tmp, meta, output)
    timings["total"] = time.perf_counter() - t_start
    size = sum(f["num_bytes"] for f in written["files"])
    logger.info(f"wrote     {output}: {len(written['files'])} {store.output_format} data file(s), {size / 1e6:.1f} MB "
                f"in {timings['write']:.1f}s (total {timings['total']:.1f}s)")
    return BuildResult(output, meta, timings, summary)


@contextlib.contextmanager
def _engine(stages: BuildStages):
    """The build's :class:`~thdpack.offline.cluster.ray_session.RaySession` under ``engine: ray`` (a local
    instance started here is shut down on leaving), else None."""
    if stages.engine != "ray":
        yield None
        return
    from thdpack.offline.cluster.ray_session import ray_session

    with ray_session(stages.ray, debug=logger.isEnabledFor(logging.DEBUG)) as session:
        yield session


def _bridge_tasks(session):
    """:func:`~thdpack.offline.commands.bridge_export.write_bridge`'s ``run`` on the cluster of ``session``: one Ray
    task per data file, converted where it was written (None: converted here)."""
    if session is None:
        return None
    from thdpack.offline.cluster.ray_tasks import run_tasks

    def run(function, shared, items):
        return run_tasks(session, function, shared, items,
                         describe=lambda k: f"converting data file {Path(items[k][1]).name} to Megatron-Bridge's format")
    return run


def _write_pack_files(store: StoreOptions, planning: PlanningOptions, tmp: Path, prep: Prepared, values: dict, *,
                      row_offset, progress: bool, ray_session=None) -> dict:
    """Write the packs of ``prep`` (in ``store.shuffle_packs`` order, seeded by the plan's seed) as data files into ``tmp``, with the
    ``values`` columns (``{name: [samples]}``) and input rows numbered from ``row_offset``; on the
    ``ray_session``'s cluster when given (one task per file);
    :func:`~thdpack.offline.store.writer.write_packs`'s result (``files``, ``target_tokens``)."""
    from thdpack.offline.store.writer import pack_files, write_packs

    plan = prep.plan
    order = (np.random.default_rng(planning.plan.seed).permutation(len(plan)) if store.shuffle_packs
             else np.arange(len(plan)))
    # on Ray the tokenized rows travel as their part files' paths (read by the tasks), not as a table
    rows = prep.tokenized.rows if ray_session is not None else prep.tokenized.dataset.data.table
    columns = {} if prep.shared_prefix is None else _prefix_columns(prep)
    if prep.mixture is not None:  # each sample's source, and its row within the source as its sample_index
        columns[SOURCE_COLUMN] = prep.mixture.row_source
        row_offset = prep.mixture.row_ids
    kwargs = dict(file_format=bridge_export.data_file_format(store.output_format), file_size_mb=store.file_size_mb,
                  row_offset=row_offset, extra=None if prep.vlm is None else prep.vlm.writer(rows), values=values,
                  **({"columns": columns} if columns else {}))
    if ray_session is None:
        return write_packs(tmp, rows, planning.targets, plan, prep.sample_rows, order, progress=progress, **kwargs)
    from thdpack.offline.cluster.ray_write import write_on_ray

    files = pack_files(rows, planning.targets, plan, prep.sample_rows, order, **kwargs)
    return write_on_ray(ray_session, files, tmp, progress=progress)


def _prefix_columns(prep: Prepared) -> dict:
    """``{column: [sequences]}`` the per-sample columns of a ``share_prefix`` build (:data:`PREFIX_COLUMNS`):
    each sequence's group number and its group's prefix, which the loader declares to ``build_thd_batch``."""
    stored = prep.shared_prefix.stored if isinstance(prep.shared_prefix, TrieShares) else prep.shared_prefix
    return dict(zip(PREFIX_COLUMNS, (prep.groups.astype(np.int64), stored.astype(np.int32))))


def _prefix_counts(prep: Prepared, min_prefix_len: int) -> dict:
    """metadata.json's ``share_prefix`` entry: the minimum, the groups and samples that share a prefix, their
    prefixes' tokens (once each) and the tokens the packs' streams save (``plan.shared_length``)."""
    plan = prep.plan
    prefix = prep.shared_prefix.one_level if isinstance(prep.shared_prefix, TrieShares) else prep.shared_prefix
    planned = prep.sample_rows[plan.sample_index]
    shared = planned[prefix[planned] > 0]
    groups, first = np.unique(prep.groups[shared], return_index=True)
    return {"min_prefix_len": int(min_prefix_len), "groups": int(groups.size), "samples": int(shared.size),
            "prefix_tokens": int(prefix[shared[first]].sum()),
            "tokens_saved": int(plan.shared_length.sum())}


def _save_tokenizer_and_model(store: StoreOptions, tmp: Path, prep: Prepared) -> dict | None:
    """Save a copy of the tokenizer (``store.save_tokenizer``) and the model config into ``tmp``; the
    tokenizer's metadata entry (None for pre-tokenized input)."""
    tok_info = prep.tokenized.tokenizer_info
    if tok_info is not None:
        tok_info = dict(tok_info, saved_copy=TOKENIZER_DIR if store.save_tokenizer else None)
        if store.save_tokenizer:
            prep.tokenized.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
    if prep.model_config is not None:
        (tmp / MODEL_CONFIG_FILE).write_text(canonical_json(prep.model_config), encoding="utf-8")
    return tok_info


def _metadata(stages: BuildStages, prep: Prepared, summary: dict, written: dict, values: dict,
              tok_info: dict | None) -> PackedMetadata:
    """``metadata.json`` of a build: the format, the options (from the resolved ``stages``), the counts and
    ``summary``, the source, tokenizer and model, the data files ``written``, the ``values`` columns' dtypes, and
    the config as given (``stages.recorded``)."""
    from thdpack.common.version import __version__

    plan, planning, store = stages.planning.plan, stages.planning, stages.store
    counts = prep.counts()
    counts["tokens"] = summary["real_tokens"]
    counts["target_tokens"] = written["target_tokens"]
    meta = PackedMetadata(
        format=FORMAT_NAME,
        format_version=FORMAT_VERSION,
        complete=True,
        thdpack_version=__version__,
        file_format=bridge_export.data_file_format(store.output_format),
        targets=planning.targets,
        columns=["input_ids", planning.targets, "seq_lens", "sample_index", "sample_start"],
        num_packs=len(prep.plan),
        pack_size=plan.pack_size,
        align=plan.align,
        cp_size=planning.cp_size,
        tp_size=planning.tp_size,
        sequence_parallel=planning.sequence_parallel,
        pad_multiple=planning.pad_multiple,
        algorithm=plan.algorithm if prep.mixture is None else prep.plan.algorithm,  # a mixture's: stratified too
        overflow=plan.overflow,
        without_targets=planning.without_targets,
        max_samples_per_pack=plan.max_samples_per_pack,
        seed=plan.seed,
        shuffle_packs=store.shuffle_packs,
        **{k: v for k, v in nemo_fields(summary).items() if k != "pack_size"},
        counts=counts,
        source=SourceInfo(format=prep.tokenized.fmt, fingerprint=prep.source.fingerprint,
                          files=[f.describe() for f in prep.source.files]),
        tokenizer=tok_info,
        model=None if prep.model_config is None else model_info(prep.model_config, stages.model_given),
        files=written["files"],
        stats=summary,
        skipped_examples=prep.skipped_examples(),
        config=dict(stages.recorded),
    )
    if values:  # sample_values: one column per value (thdpack/offline/store/schema.py)
        meta["sample_values"] = {name: str(v.dtype) for name, v in values.items()}
        meta["columns"] += [SAMPLE_VALUE_PREFIX + name for name in values]
    if prep.shared_prefix is not None:  # share_prefix: the group and prefix columns the loader reads
        meta["share_prefix"] = _prefix_counts(prep, planning.min_prefix)
        meta["columns"] += list(PREFIX_COLUMNS)
        meta["counts"]["tokens"] = int(prep.plan.length.sum())  # stored: each sample whole (the stream's: stats)
    if prep.mixture is not None:  # per source: read, kept, blended, dropped, packed; the source_index column
        meta["mixture"] = prep.mixture.report
        meta["columns"].append(SOURCE_COLUMN)
    return meta


# ---------------------------------------------------------------------------- raw stats


def analyze(cfg: BuildConfig, *, eval_multiple: int | None = None, progress: bool = True) -> dict:
    """Statistics of planning ``cfg`` without writing anything (``thdpack stats`` on raw data)."""
    import tempfile

    progress = check_bool(progress, "progress")
    with tempfile.TemporaryDirectory(prefix="thdpack-stats-") as d:
        prep = prepare(cfg, Path(d), progress=progress)
        summary = prep.summary(eval_multiple)
        summary["skipped_examples"] = prep.skipped_examples()
        if prep.mixture is not None:
            summary["mixture"] = prep.mixture.report
        del prep
    return summary
