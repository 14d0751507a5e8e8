"""``thdpack merge``: combine the outputs of ``thdpack build --slice i/N`` into one packed dataset.

The merged dataset is a normal packed dataset (:func:`load_packed`, ``thdpack stats``,
``thdpack inspect`` read it): its packs are the slices' packs in slice order (each
slice's in its own written order), its data files are the slices' data files, copied
byte for byte (or hard-linked with ``link=True``) and renumbered, and ``sample_index``
already holds rows of the whole input. ``metadata.json`` is recomputed: counts are
summed, the statistics (lengths, efficiency, padding, FLOPs, NeMo fields) are computed
again from every pack's ``seq_lens`` and the slices' recorded input lengths, and a
``input_slices`` entry records the slice count and row ranges. The result is what one
process would write if it planned each slice's rows on their own and wrote the packs
in that order; ``tests/test_slice_merge.py`` checks this against such a build. VLM
builds merge too: the vision columns travel in the data files, the ``vision`` entry's
image and patch counts are recomputed from the packs, the image processor is copied.

Before writing, the slices are checked: each is a complete slice build; all have the
same slice count, every index ``0..N-1`` exactly once; the same options, input
(source fingerprint), tokenizer and thdpack version; row ranges that match the count;
and every file's size and sha256 (checked while copying). The output is written like
``thdpack build`` (:func:`thdpack.offline.store.staging.start_output`, the same lock and checks):
into a hidden temporary directory, renamed into place last, never replacing an existing
directory without ``overwrite``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from thdpack.common.align import check_bool
from thdpack.offline.store.dataset import read_metadata
from thdpack.offline.errors import MAX_ERRORS_RECORDED, NotPackedError, OfflineError
from thdpack.offline.store.schema import (LIST_COLUMNS, METADATA_FILE, PackedMetadata, bytes_sha256, data_file_name,
                                    file_sha256)
from thdpack.offline.inputs.input_slice import MERGED_KEY, SLICE_KEY, slice_info, slice_rows
from thdpack.offline.procs import check_signals
from thdpack.offline.store.staging import commit_staged, fsync_file, staged_output
from thdpack.offline.store.vision_columns import PROCESSOR_DIR, VISION_COLUMNS

logger = logging.getLogger(__name__)
# metadata entries that differ from slice to slice (recomputed); every other entry must agree
PER_SLICE_KEYS = {
    "num_packs", "counts", "files", "stats", "skipped_examples", SLICE_KEY,
    "dataset_max_seqlen", "max_samples_per_bin", "packing_factor", "packing_efficiency", "min_packed_seqlen",
}
SAVED_COPIES = ("tokenizer", "model")  # metadata entries whose "saved_copy" file/dir is copied from slice 0
VISION_PER_SLICE_KEYS = {"images", "videos", "video_patches_cut", "vision_patches", "max_pack_vision_patches"}  # of a VLM build's "vision" entry


class SliceMismatchError(OfflineError):
    """The slices given to ``thdpack merge`` do not belong together."""


@dataclass
class MergeResult:
    path: Path
    metadata: PackedMetadata
    summary: dict


# ---------------------------------------------------------------------------- finding and checking slices


def expand_slice_paths(specs) -> list[Path]:
    """Slice directories from paths, globs (``out/parts/*``) and parent directories (their
    sub-directories holding ``metadata.json``), sorted and de-duplicated."""
    found: list[Path] = []
    for spec in [specs] if isinstance(specs, (str, os.PathLike)) else specs:
        text = os.fspath(spec)
        if any(ch in text for ch in "*?["):
            hits = sorted(Path(p) for p in glob.glob(text))
            hits = [p for p in hits if p.is_dir()]
            if not hits:
                raise NotPackedError(f"slice pattern {text!r} matches no directory")
            found.extend(hits)
            continue
        p = Path(text)
        if p.is_dir() and not (p / METADATA_FILE).exists():
            subs = sorted(c for c in p.iterdir() if c.is_dir() and (c / METADATA_FILE).is_file())
            if subs:
                found.extend(subs)
                continue
        found.append(p)
    out, seen = [], set()
    for p in found:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            out.append(p)
    if not out:
        raise NotPackedError("no slice directories given")
    return out


def _diff_keys(a, b) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return sorted(k for k in set(a) | set(b) if a.get(k, object) != b.get(k, object))
    return []


def _shared(meta: dict, key: str):
    """``meta[key]`` without what differs from slice to slice (the image counts of a VLM build)."""
    value = meta.get(key, object)
    if key == "vision" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in VISION_PER_SLICE_KEYS}
    if key == "megatron_bridge" and isinstance(value, dict):  # its files and totals are per slice (bridge_export.py)
        from thdpack.offline.commands.bridge_export import SETTINGS

        return {k: value.get(k) for k in SETTINGS}
    return value


def check_slices(paths) -> list[tuple[Path, PackedMetadata]]:
    """``[(path, metadata)]`` of the slices in index order; :class:`SliceMismatchError` (or
    :class:`NotPackedError`) with a message naming the culprits when they do not form one build."""
    slices = []
    for p in paths:
        meta = read_metadata(p)
        info = slice_info(meta)
        if not isinstance(info, dict):
            raise SliceMismatchError(
                f"{p} is a packed dataset but not a slice build (no '{SLICE_KEY}' in {METADATA_FILE}); "
                "build slices with thdpack build --slice I/N"
            )
        slices.append((Path(p), meta, info))

    counts: dict[int, list[Path]] = {}
    for p, _, info in slices:
        counts.setdefault(info["count"], []).append(p)
    if len(counts) > 1:
        detail = "; ".join(f"N={n}: {', '.join(map(str, ps[:3]))}{' ...' if len(ps) > 3 else ''}"
                           for n, ps in sorted(counts.items()))
        raise SliceMismatchError(f"the slices come from builds with different slice counts ({detail})")
    n = next(iter(counts))
    by_index: dict[int, list[Path]] = {}
    for p, _, info in slices:
        by_index.setdefault(info["index"], []).append(p)
    dups = {i: ps for i, ps in by_index.items() if len(ps) > 1}
    if dups:
        detail = "; ".join(f"slice {i}/{n}: {', '.join(map(str, ps))}" for i, ps in sorted(dups.items()))
        raise SliceMismatchError(f"slice index given more than once ({detail})")
    missing = [i for i in range(n) if i not in by_index]
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        raise SliceMismatchError(
            f"missing {len(missing)} of {n} slices: index {shown} (got {len(slices)} slice directories); "
            "build the missing ones (thdpack build --slice I/N) or pass all of them"
        )
    slices.sort(key=lambda s: s[2]["index"])

    p0, m0, i0 = slices[0]
    for p, meta, info in slices[1:]:
        for key in sorted(set(m0) | set(meta), key=lambda k: (k != "source", k)):  # the input first
            if key in PER_SLICE_KEYS or _shared(m0, key) == _shared(meta, key):
                continue
            sub = _diff_keys(m0.get(key), meta.get(key))
            if key == "source":
                why = ("they were built from different inputs (source fingerprint "
                       f"{str(m0['source'].get('fingerprint'))[:12]}… vs {str(meta['source'].get('fingerprint'))[:12]}…)")
            elif key == "config":
                why = f"they were built with different options ({', '.join(sub)})"
            else:
                why = f"'{key}' differs" + (f" ({', '.join(sub)})" if sub else "")
            raise SliceMismatchError(
                f"slices {i0['index']} ({p0}) and {info['index']} ({p}) do not belong together: {why}; "
                "build every slice with the same command and input"
            )
        if info.get("input_rows") != i0.get("input_rows"):
            raise SliceMismatchError(
                f"slices {i0['index']} ({p0}) and {info['index']} ({p}) saw inputs of "
                f"{i0.get('input_rows')} and {info.get('input_rows')} rows"
            )
    for p, _, info in slices:
        want = slice_rows(info["input_rows"], info["index"], n)
        if (info["row_start"], info["row_stop"]) != want:
            raise SliceMismatchError(
                f"{p}: slice {info['index']}/{n} covers rows {info['row_start']}..{info['row_stop']}, "
                f"expected {want[0]}..{want[1]} of {info['input_rows']}"
            )
    known = LIST_COLUMNS + (VISION_COLUMNS if "vision" in m0 else ())
    extra = [c for c in m0.get("columns", []) if c not in known]
    if extra:
        raise SliceMismatchError(f"merging builds with columns {extra} is not supported")
    return [(p, m) for p, m, _ in slices]


# ---------------------------------------------------------------------------- merging


def _copy_checked(src: Path, dst: Path, entry: dict, *, link: bool) -> None:
    """Copy (or hard-link) ``src`` to ``dst``, checking its size and sha256 against ``entry``."""
    if not src.is_file():
        raise NotPackedError(f"{src} listed in {src.parent / METADATA_FILE} is missing")
    if src.stat().st_size != entry["num_bytes"]:
        raise NotPackedError(f"{src} has {src.stat().st_size} bytes, metadata says {entry['num_bytes']} (modified or truncated)")
    if link:
        try:
            os.link(src, dst)
        except OSError as exc:
            raise OfflineError(f"cannot hard-link {src} into the output ({exc}); merge without --link to copy") from None
    else:
        shutil.copyfile(src, dst)
        fsync_file(dst)
    if file_sha256(dst) != entry["sha256"]:
        raise NotPackedError(f"{src} does not match its sha256 in {METADATA_FILE} (modified or corrupt)")


def _copy_saved(src: Path, dst: Path) -> None:
    """Copy a slice's saved file or directory (tokenizer, model config, image processor) to ``dst``:
    a file as ``shutil.copyfile``, a directory as ``shutil.copytree``, except that a file it cannot
    read raises its own ``OSError`` naming it (copytree gathers every failure into one
    ``shutil.Error`` of strings)."""
    if not src.is_dir():
        shutil.copyfile(src, dst)
        return
    dst.mkdir()
    for child in sorted(src.iterdir()):
        if child.is_dir():
            _copy_saved(child, dst / child.name)
        else:
            shutil.copy2(child, dst / child.name)
    shutil.copystat(src, dst)


def _list_columns(path: Path, file_format: str, names: list[str]) -> dict:
    """``{name: (values, values per pack)}`` (int64) of list columns ``names`` of one data file,
    reading the file once and only those columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if file_format == "parquet":
        table = pq.read_table(path, columns=names)
    else:
        table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all().select(names)
    out = {}
    for name in names:
        col = table.column(name)
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        offsets = np.asarray(col.offsets).astype(np.int64)
        values = np.asarray(col.values.to_numpy(zero_copy_only=False), dtype=np.int64)[offsets[0] : offsets[-1]]
        out[name] = (values, np.diff(offsets))
    return out


def _sum_counts(items: list, where: str = "counts"):
    first = items[0]
    if isinstance(first, dict):
        keys = list(first)
        if any(list(d) != keys for d in items if isinstance(d, dict)) or not all(isinstance(d, dict) for d in items):
            raise SliceMismatchError(f"the slices record different '{where}' entries")
        return {k: _sum_counts([d[k] for d in items], f"{where}.{k}") for k in keys}
    if all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        return sum(items)
    if all(v == first for v in items):
        return first
    raise SliceMismatchError(f"cannot merge '{where}': {items[:4]}")


def _load_lengths(path: Path, info: dict) -> np.ndarray:
    entry = info.get("input_lengths") or {}
    p = path / entry.get("path", "")
    if not entry or not p.is_file():
        raise NotPackedError(f"{path}: the slice's input lengths file ({entry.get('path')}) is missing")
    data = p.read_bytes()
    if len(data) != entry["num_bytes"] or bytes_sha256(data) != entry["sha256"]:
        raise NotPackedError(f"{p} does not match its size/sha256 in {METADATA_FILE} (modified or corrupt)")
    return np.load(p, allow_pickle=False).astype(np.int64, copy=False)


def merged_metadata(slices: list[tuple[Path, dict]], seq_lens: np.ndarray, pack_offsets: np.ndarray,
                    input_lengths: np.ndarray, files: list[dict], model_config=None, vision=None) -> PackedMetadata:
    """The metadata of the merged dataset (see the module docstring). ``vision``: for a VLM
    build, ``(grids, pack_patches, video_grids)``: int64 ``[N, 3]`` grids of every image, the
    vision patches (images and videos) of every pack, in the merged pack order, and int64
    ``[V, 3]`` grids of every video."""
    from thdpack.offline.commands.pack_stats import nemo_fields, summarize

    metas = [m for _, m in slices]
    first = metas[0]
    counts = _sum_counts([m["counts"] for m in metas])
    kw = {"model_config": model_config} if model_config is not None else {}
    if model_config is not None and vision is not None:
        kw["vision_grid_thw"] = vision[0]
    summary = summarize(seq_lens, pack_offsets, first["pack_size"], first["align"], input_lengths=input_lengths, **kw)
    for key in first.get("stats", {}):  # counters the build appends to the statistics
        if key not in summary:
            if key not in counts:
                raise SliceMismatchError(f"cannot merge the per-slice statistic '{key}'")
            summary[key] = counts[key]
    skipped = [e for m in metas for e in m.get("skipped_examples", [])][:MAX_ERRORS_RECORDED]
    nemo = {k: v for k, v in nemo_fields(summary).items() if k != "pack_size"}
    meta: PackedMetadata = {}
    for key, value in first.items():
        if key == SLICE_KEY:
            continue
        if key in nemo:
            value = nemo[key]
        elif key == "num_packs":
            value = int(pack_offsets.size - 1)
        elif key == "counts":
            value = counts
        elif key == "files":
            value = files
        elif key == "stats":
            value = summary
        elif key == "skipped_examples":
            value = skipped
        elif key == "vision" and vision is not None:
            grids, pack_patches, video_grids = vision
            value = dict(value, images=int(grids.shape[0]), vision_patches=int(pack_patches.sum()),
                         max_pack_vision_patches=int(pack_patches.max()) if pack_patches.size else 0)
            if "videos" in value:
                value.update(videos=int(video_grids.shape[0]),
                             video_patches_cut=sum(int(m["vision"].get("video_patches_cut", 0)) for m in metas))
        meta[key] = value
    meta[MERGED_KEY] = {
        "count": len(metas),
        "plan": "slice-local: each input slice's rows were planned on their own; packs are in slice order",
        "row_ranges": [[slice_info(m)["row_start"], slice_info(m)["row_stop"]] for m in metas],
        "num_packs": [m["num_packs"] for m in metas],
    }
    return meta


def merge_slices(
    slice_paths,
    output: str | Path,
    *,
    overwrite: bool = False,
    link: bool = False,
) -> MergeResult:
    """Merge the slice builds at ``slice_paths`` (paths, globs or a parent directory) into ``output``.
    The summary line goes to ``logging.getLogger("thdpack.offline.commands.slice_merge")``."""
    return _merge(slice_paths, Path(output), check_bool(overwrite, "overwrite"), check_bool(link, "link"))


def _merge(slice_paths, output: Path, overwrite: bool, link: bool) -> MergeResult:
    paths = expand_slice_paths(slice_paths)
    slices = check_slices(paths)
    for p, _ in slices:
        if output.resolve() == p.resolve():
            raise OfflineError(f"output {output} is one of the slices being merged")
    first_path, first = slices[0]
    fmt = first["file_format"]
    n_files = sum(len(m["files"]) for _, m in slices)
    with staged_output(output, overwrite) as tmp:
        files, lens, per_pack, lengths = [], [], [], []
        vision_entry = first.get("vision")
        grids, per_pack_images = {"image_grid_thw": [], "video_grid_thw": []}, {"image_grid_thw": [], "video_grid_thw": []}
        grid_columns = [c for c in ("image_grid_thw", "video_grid_thw") if vision_entry and c in first["columns"]]
        for p, meta in slices:
            for f in meta["files"]:
                check_signals()
                name = data_file_name(len(files), n_files, fmt)
                _copy_checked(p / f["path"], tmp / name, f, link=link)
                files.append(dict(f, path=name))
                check_signals()
                read = _list_columns(tmp / name, fmt, ["seq_lens"] + grid_columns)
                s, c = read["seq_lens"]
                if c.size != f["num_packs"]:
                    raise NotPackedError(f"{p / f['path']} has {c.size} packs, metadata says {f['num_packs']}")
                lens.append(s)
                per_pack.append(c)
                for column in grid_columns:
                    g, n3 = read[column]
                    grids[column].append(g.reshape(-1, 3))
                    per_pack_images[column].append(n3 // 3)
            check_signals()
            lengths.append(_load_lengths(p, slice_info(meta)))
        check_signals()
        seq_lens = np.concatenate(lens) if lens else np.zeros(0, np.int64)
        offsets = np.zeros(sum(c.size for c in per_pack) + 1, dtype=np.int64)
        if per_pack:
            np.cumsum(np.concatenate(per_pack), out=offsets[1:])
        model_config = None
        for key in SAVED_COPIES:
            entry = first.get(key)
            if isinstance(entry, dict) and entry.get("saved_copy"):
                src = first_path / entry["saved_copy"]
                if not src.exists():
                    raise NotPackedError(f"{first_path}: {entry['saved_copy']} (the saved {key}) is missing")
                _copy_saved(src, tmp / entry["saved_copy"])
                if key == "model":
                    model_config = json.loads(src.read_text(encoding="utf-8"))
        vision = None
        if vision_entry is not None:
            saved = vision_entry.get("saved_processor", PROCESSOR_DIR)
            if not (first_path / saved).is_dir():
                raise NotPackedError(f"{first_path}: {saved} (the saved image processor) is missing")
            _copy_saved(first_path / saved, tmp / saved)
            image_grids, image_patches = _vision_totals(grids["image_grid_thw"], per_pack_images["image_grid_thw"])
            video_grids, video_patches = _vision_totals(grids["video_grid_thw"], per_pack_images["video_grid_thw"])
            vision = (image_grids, image_patches + (video_patches if video_patches.size else 0), video_grids)
        meta = merged_metadata(slices, seq_lens, offsets, np.concatenate(lengths), files, model_config, vision)
        if "megatron_bridge" in first:  # output_format megatron-bridge: Bridge's files of the merged packs
            from thdpack.offline.commands.bridge_export import write_merged

            meta["megatron_bridge"] = write_merged(tmp, meta, first["megatron_bridge"])
        commit_staged(tmp, meta, output)
    size = sum(f["num_bytes"] for f in files)
    logger.info(f"merged    {len(slices)} slices into {output}: {meta['num_packs']:,} packs, {len(files)} {fmt} file(s), "
                f"{size / 1e6:.1f} MB ({'hard-linked' if link else 'copied'})")
    return MergeResult(output, meta, meta["stats"])


def _vision_totals(grids: list, per_pack_images: list) -> tuple[np.ndarray, np.ndarray]:
    """(int64 ``[N, 3]`` grids of every image, int64 vision patches of every pack)."""
    g = np.concatenate(grids) if grids else np.zeros((0, 3), np.int64)
    counts = np.concatenate(per_pack_images) if per_pack_images else np.zeros(0, np.int64)
    cum = np.zeros(g.shape[0] + 1, np.int64)
    np.cumsum(g.prod(axis=1), out=cum[1:])
    first = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=first[1:])
    return g, cum[first[1:]] - cum[first[:-1]]
