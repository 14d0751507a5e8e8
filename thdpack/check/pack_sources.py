"""The packs ``thdpack check`` runs, read from the user's data: a packed build (``thdpack build`` output: its
packs as built, with the alignment it recorded), or a build config / raw input planned on the fly as
``thdpack build`` would plan it (a JSON Lines file of token ids is the ``tokenized`` format), without writing.

:func:`read_packs` picks a seeded sample of ``count`` packs and returns their samples (``input_ids`` and
``labels`` or ``loss_mask``; VLM builds: their vision inputs too), and for a packed build each pack's batch as
its own loader collates it (``load_packed(path).collator()``: the recorded alignment, a VLM build's mRoPE rows);
a planned pack is built by ``build_thd_batch`` with the layout keywords it was planned with (``pad_token_id``,
``cp_size``, ``tp_size``, ``sequence_parallel``, ``pad_multiple``).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from thdpack.offline.config import BuildConfig
from thdpack.offline.errors import ConfigError, NotPackedError

LAYOUT_KEYS = ("cp_size", "tp_size", "sequence_parallel", "pad_multiple")


@dataclass
class Pack:
    """One pack: its number in the dataset or plan, its samples, where each came from (``where``) and, for a
    packed build's pack, the :class:`~thdpack.ThdBatch` its own loader gives (``load_packed(...).collator()``)."""

    index: int
    samples: list[dict]
    where: list[str]
    batch: object = None


@dataclass
class Packs:
    """The packs picked from a data source (``description``: what it is and how many packs it has) and the
    layout keywords they were planned with (``build_thd_batch`` rebuilds a planned pack with them)."""

    description: str
    total: int
    packs: list[Pack] = field(default_factory=list)
    layout: dict = field(default_factory=dict)


def read_packs(data, *, count: int = 3, seed: int = 0, pack_size: int | None = None,
               progress: bool = False) -> Packs:
    """``count`` packs of ``data`` (all of them when it has fewer), picked by a generator seeded with
    ``seed``, in pack order.

    ``data``: a packed build directory (``thdpack build`` output), a :class:`BuildConfig`, the path of a
    build's YAML config, or raw input that needs no tokenizer (a JSON Lines file of ``input_ids`` and
    ``labels`` or ``loss_mask``) planned into packs of ``pack_size`` tokens; planned here, nothing written.
    ``ValueError`` / ``OfflineError`` in one line for what cannot be checked as the build makes it (a
    ``share_prefix`` build, a VLM config not yet built).
    """
    if isinstance(data, BuildConfig):
        return _planned_packs(data, count, seed, progress)
    path = Path(data)
    if path.is_dir() and (path / "metadata.json").is_file():
        return _built_packs(path, count, seed)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return _planned_packs(BuildConfig.from_yaml(path), count, seed, progress)
    from thdpack.offline.store.schema import looks_packed

    if looks_packed(path):
        raise NotPackedError(f"{path} holds the data files of a packed build but no metadata.json: the build did "
                             "not complete; rebuild it")
    if not path.exists():
        raise ConfigError(f"{path} does not exist (a packed build, a build config or a JSON Lines file)")
    if pack_size is None:
        raise ConfigError(f"{path}: raw input is planned into packs: give pack_size (--pack-size N)")
    return _planned_packs(BuildConfig(input=str(path), pack_size=pack_size), count, seed, progress)


def pick(total: int, count: int, seed: int) -> list[int]:
    """``count`` of ``range(total)`` (all when fewer), drawn without replacement by a generator seeded with
    ``seed``, sorted."""
    if total <= count:
        return list(range(total))
    return sorted(int(k) for k in np.random.default_rng(seed).choice(total, size=count, replace=False))


def _built_packs(path: Path, count: int, seed: int) -> Packs:
    """Packs of a packed build: each one's samples as stored (:func:`thdpack.offline.store.dataset.unpack_row`)
    and its batch as the build's own loader collates it (its CP / pad alignment, a VLM build's vision inputs
    and mRoPE rows from its saved model config)."""
    from thdpack.offline.store.dataset import load_packed, unpack_row

    ds = load_packed(path)
    meta = ds.metadata
    if meta.get("share_prefix"):
        raise ConfigError(f"{path}: a share_prefix build lays each group's prefix out once, so a sample's tokens "
                          "are not one span of its pack; thdpack check compares spans: check a build without "
                          "share_prefix")
    tok = meta.get("tokenizer") or {}
    layout = {"pad_token_id": tok.get("pad_token_id") or 0, **{k: meta[k] for k in LAYOUT_KEYS if k in meta}}
    out = Packs(f"{path}: packed build, {len(ds)} packs of {meta['pack_size']} tokens (align {meta['align']})",
                len(ds), layout=layout)
    collate = ds.collator()
    for k in pick(len(ds), count, seed):
        row = ds[k]
        rows = np.asarray(row["sample_index"]).tolist()
        out.packs.append(Pack(k, unpack_row(row), [f"input row {r}" for r in rows], collate([row])))
    return out


def _planned_packs(cfg: BuildConfig, count: int, seed: int, progress: bool) -> Packs:
    """Packs of ``cfg`` planned as ``thdpack build`` plans them (read, tokenize, plan; nothing written),
    numbered as the build would write them (its ``shuffle_packs`` order)."""
    from thdpack.offline.commands.build_packs import prepare
    from thdpack.offline.stages import BuildStages

    stages = BuildStages.from_config(cfg)
    planning = stages.planning
    with tempfile.TemporaryDirectory(prefix="thdpack-check-") as work:
        prep = prepare(cfg, Path(work), progress=progress)
        try:
            if prep.vlm is not None or prep.shared_prefix is not None:
                what = "rows with images or videos" if prep.vlm is not None else "share_prefix"
                raise ConfigError(f"a build of {what} is checked once built: thdpack build --config ... --output "
                                  "OUT, then thdpack check OUT --model ...")
            plan = prep.plan
            order = (np.random.default_rng(planning.plan.seed).permutation(len(plan)) if stages.store.shuffle_packs
                     else np.arange(len(plan)))  # the build's pack j is the plan's pack order[j]
            info = prep.tokenized.tokenizer_info or {}
            layout = {"pad_token_id": info.get("pad_token_id") or 0,
                      **{k: getattr(planning, k) for k in LAYOUT_KEYS}}
            source = cfg.source.input if isinstance(cfg.source.input, str) else "the config's input"
            out = Packs(f"{source}: planned, {len(plan)} packs of {plan.pack_size} tokens (align {plan.align}, "
                        f"{plan.algorithm})", len(plan), layout=layout)
            out.packs = [_planned_pack(prep, planning.targets, j, int(order[j])) for j in pick(len(plan), count, seed)]
        finally:
            del prep  # release the memory-mapped rows before their directory goes
    return out


def _planned_pack(prep, targets: str, number: int, k: int) -> Pack:
    """Pack ``k`` of ``prep``'s plan, the build's pack ``number``: its pieces copied out of the tokenized rows."""
    from thdpack.offline.store.gather import RowPieces

    plan, table = prep.plan, prep.tokenized.dataset.data.table
    pieces = np.arange(plan.pack_offsets[k], plan.pack_offsets[k + 1])
    rows = prep.sample_rows[plan.sample_index[pieces]]
    starts, lengths = plan.start[pieces], plan.length[pieces]
    cuts = np.cumsum(lengths)[:-1]
    columns = {name: np.split(RowPieces(table, name).gather(rows, starts, lengths), cuts)
               for name in ("input_ids", targets)}
    samples = [{name: parts[i] for name, parts in columns.items()} for i in range(len(pieces))]
    same_rows = prep.mixture is None and prep.tokenized.lengths.size == prep.source.num_rows
    where = [prep.source.where(int(r)) if same_rows else f"tokenized row {int(r)}" for r in rows]
    return Pack(number, samples, where)
