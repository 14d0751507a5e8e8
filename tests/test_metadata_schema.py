"""Packed datasets read back (issue 11, section 6): a hand-edited ``metadata.json`` or a
damaged data file is refused with one clear line naming the key, the file and the pack,
never a ``KeyError``/``TypeError`` traceback or a failure later in training.

One small build with the bundled demo tokenizer; each test edits a copy of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")

from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline import BuildConfig, NotPackedError, build_packed, load_packed  # noqa: E402
from thdpack.offline.errors import OfflineError  # noqa: E402

PACK_SIZE = 1024


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A packed dataset of 60 chat rows, pack_size 1024, two Arrow data files."""
    d = tmp_path_factory.mktemp("schema")
    src = write_jsonl(generate_rows(60, seed=5, kind="chat"), d / "chat.jsonl")
    cfg = BuildConfig(input=str(src), tokenizer=str(TOKENIZER_DIR), pack_size=PACK_SIZE, overflow="truncate",
                      file_size_mb=0.05)
    return build_packed(cfg, d / "packed", progress=False).path


@pytest.fixture
def ds_copy(built, tmp_path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(built, out)
    return out


def edit_meta(path: Path, change) -> dict:
    meta = json.loads((path / "metadata.json").read_text())
    change(meta)
    (path / "metadata.json").write_text(json.dumps(meta))
    return meta


def test_the_fixture_loads_and_has_full_packs(built):
    ds = load_packed(built, verify=True)
    assert len(ds.metadata["files"]) >= 2  # per-file checks see more than one data file
    assert ds.pack_num_tokens().max() > PACK_SIZE // 2  # lowering pack_size below it is caught


def test_packed_metadata_type_names_every_key_and_writes_the_file_as_built(built):
    """:class:`PackedMetadata` holds every key the schema checks and every key a build writes;
    :func:`metadata_text` gives back the file byte for byte."""
    from thdpack.offline.store.schema import METADATA_SCHEMA, PackedMetadata, metadata_text

    text = (built / "metadata.json").read_text(encoding="utf-8")
    meta = json.loads(text)
    assert set(METADATA_SCHEMA) | set(meta) <= set(PackedMetadata.__annotations__)
    assert metadata_text(meta) == text


@pytest.mark.parametrize("verify", [False, True])
def test_pack_size_smaller_than_the_longest_pack_is_refused(ds_copy, verify):
    longest = int(load_packed(ds_copy).pack_num_tokens().max())
    edit_meta(ds_copy, lambda m: m.update(pack_size=longest - 1))
    with pytest.raises(NotPackedError, match=rf"{longest} tokens, more than 'pack_size' \({longest - 1}\)") as err:
        load_packed(ds_copy, verify=verify)
    assert "data-0000" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "change, key",
    [
        (lambda m: m.pop("files"), "'files' is missing"),
        (lambda m: m.update(pack_size="1024"), "'pack_size' must be an integer >= 1, got '1024' (str)"),
        (lambda m: m.update(pack_size=0), "'pack_size' must be an integer >= 1, got 0"),
        (lambda m: m.update(num_packs=True), "'num_packs' must be an integer >= 0, got True (bool)"),
        (lambda m: m.update(files={}), "'files' must be a list"),
        (lambda m: m["files"][1].pop("num_bytes"), "'files[1].num_bytes' is missing"),
        (lambda m: m["files"][0].update(path=3), "'files[0].path' must be a string"),
        (lambda m: m.update(file_format="csv"), "'file_format' must be one of 'arrow', 'parquet'"),
        (lambda m: m.update(targets="mask"), "'targets' must be one of 'loss_mask', 'labels'"),
        (lambda m: m.pop("counts"), "'counts' is missing"),
        (lambda m: m["counts"].update(samples=-1), "'counts.samples' must be an integer >= 0"),
        (lambda m: m.update(tokenizer=[]), "'tokenizer' must be an object or null"),
        (lambda m: m["tokenizer"].update(vocab_size="3072"), "'tokenizer.vocab_size' must be an integer >= 1"),
        (lambda m: m["source"].pop("files"), "'source.files' is missing"),
        (lambda m: m.update(align=None), "'align' must be an integer >= 1, got None"),
        (lambda m: m.update(cp_size=2.0), "'cp_size' must be an integer >= 1, got 2.0"),
        (lambda m: m.update(format_version="1"), "'format_version' must be an integer >= 1"),
    ],
)
def test_wrong_or_missing_keys_name_the_key(ds_copy, change, key):
    edit_meta(ds_copy, change)
    with pytest.raises(NotPackedError) as err:
        load_packed(ds_copy)
    msg = str(err.value)
    assert key in msg
    assert msg.startswith(str(ds_copy / "metadata.json")) and "\n" not in msg


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda m: m.update(num_packs=m["num_packs"] + 1), "'num_packs'"),
        (lambda m: m["counts"].update(tokens=m["counts"]["tokens"] - 1), "'counts.tokens'"),
        (lambda m: m["counts"].update(pieces=m["counts"]["pieces"] + 1), "'counts.pieces'"),
        (lambda m: (m["files"].append(dict(m["files"][0])), m.update(num_packs=m["num_packs"] + m["files"][0]["num_packs"]),
                    m["counts"].update(tokens=m["counts"]["tokens"] + m["files"][0]["num_tokens"])), "listed twice"),
        (lambda m: m["files"][0].update(path=m["files"][0]["path"].replace(".arrow", ".parquet")), "'.arrow'"),
    ],
)
def test_inconsistent_counts_are_refused(ds_copy, change, what):
    edit_meta(ds_copy, change)
    with pytest.raises(NotPackedError, match="metadata.json") as err:
        load_packed(ds_copy)
    assert what in str(err.value)


@pytest.mark.parametrize("field, delta", [("num_packs", 1), ("num_tokens", -1)])
def test_a_data_files_counts_are_checked_against_its_rows(ds_copy, field, delta):
    """Each data file's recorded packs/tokens against its data (totals kept consistent)."""

    def change(m):
        m["files"][0][field] += delta
        m["files"][1][field] -= delta

    meta = edit_meta(ds_copy, change)
    with pytest.raises(NotPackedError, match=meta["files"][0]["path"]) as err:
        load_packed(ds_copy)
    assert field.split("_")[1] in str(err.value)


@pytest.mark.parametrize("where", ["../outside.arrow", "sub/../../outside.arrow", "absolute"])
def test_data_file_paths_outside_the_dataset_are_refused(ds_copy, tmp_path, where):
    first = ds_copy / json.loads((ds_copy / "metadata.json").read_text())["files"][0]["path"]
    outside = tmp_path / "outside.arrow"
    shutil.copy(first, outside)  # a real data file, so only the location is wrong
    rel = str(outside) if where == "absolute" else where
    edit_meta(ds_copy, lambda m: m["files"][0].update(path=rel))
    with pytest.raises(NotPackedError, match="outside the dataset directory") as err:
        load_packed(ds_copy)
    assert f"'files[0].path' ({rel!r})" in str(err.value)


def test_a_symlink_escaping_the_directory_is_refused(ds_copy, tmp_path):
    meta = json.loads((ds_copy / "metadata.json").read_text())
    name = meta["files"][0]["path"]
    (tmp_path / "elsewhere.arrow").write_bytes((ds_copy / name).read_bytes())
    (ds_copy / name).unlink()
    (ds_copy / name).symlink_to(tmp_path / "elsewhere.arrow")
    with pytest.raises(NotPackedError, match="outside the dataset directory"):
        load_packed(ds_copy)


def zero_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:64] = bytes(64)
    path.write_bytes(bytes(data))


def test_a_zeroed_arrow_header_names_the_file(ds_copy):
    name = json.loads((ds_copy / "metadata.json").read_text())["files"][1]["path"]
    zero_header(ds_copy / name)
    with pytest.raises(NotPackedError) as err:
        load_packed(ds_copy)
    msg = str(err.value)
    assert msg.startswith(f"{ds_copy / name}: not a valid Arrow stream (") and "--verify" in msg
    assert "\n" not in msg


def test_a_zeroed_parquet_header_names_the_file(built, tmp_path):
    src = Path(json.loads((built / "metadata.json").read_text())["source"]["files"][0]["path"])
    cfg = BuildConfig(input=str(src), tokenizer=str(TOKENIZER_DIR), pack_size=PACK_SIZE, overflow="truncate",
                      output_format="parquet")
    out = build_packed(cfg, tmp_path / "pq", progress=False).path
    name = json.loads((out / "metadata.json").read_text())["files"][0]["path"]
    data = bytearray((out / name).read_bytes())
    data[-64:] = bytes(64)  # Parquet's footer is its header
    (out / name).write_bytes(bytes(data))
    with pytest.raises(NotPackedError, match=rf"^{out / name}: not a valid Parquet file \(.*--verify"):
        load_packed(out)


def rewrite_data_file(path: Path, column: str, edit) -> None:
    """Rewrite Arrow data file ``path`` with ``edit(values)`` applied to ``column``'s flat values
    in its first record batch, as a bit flip would (same schema, same sizes)."""

    def on_values(col):
        values = col.values.to_numpy().copy()
        edit(values)
        return pa.ListArray.from_arrays(col.offsets, pa.array(values, col.type.value_type))

    rewrite_column(path, column, on_values)


def rewrite_column(path: Path, column: str, edit) -> None:
    """Rewrite Arrow data file ``path`` with list column ``column`` of its first record batch
    replaced by ``edit(column)``."""
    table = pa.ipc.open_stream(pa.py_buffer(path.read_bytes())).read_all()  # not mapped: the file is rewritten
    batches = [b for b in table.to_batches() if b.num_rows]
    cols = list(batches[0].columns)
    i = batches[0].schema.get_field_index(column)
    cols[i] = edit(cols[i])
    batches[0] = pa.RecordBatch.from_arrays(cols, schema=batches[0].schema)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for b in batches:
            w.write_batch(b)


@pytest.mark.parametrize("bad", [-2147483645, 3072, 2**30])
def test_an_id_outside_the_vocabulary_names_file_and_pack(ds_copy, bad):
    meta = json.loads((ds_copy / "metadata.json").read_text())
    name = meta["files"][1]["path"]
    first = meta["files"][0]["num_packs"]  # packs before this data file

    def flip(values):
        values[5] = bad  # pack 0 of this data file, token 5

    rewrite_data_file(ds_copy / name, "input_ids", flip)
    assert (ds_copy / name).stat().st_size == meta["files"][1]["num_bytes"]
    ds = load_packed(ds_copy)  # without verify: sizes match
    ds[first + 1]  # other packs still read
    with pytest.raises(NotPackedError) as err:
        ds[first]
    msg = str(err.value)
    assert msg.startswith(f"{ds_copy / name}: pack 0 (pack {first} of the dataset)")
    assert f"token 5 has id {bad}" in msg and "vocabulary of 3072" in msg and "--verify" in msg
    with pytest.raises(NotPackedError, match="sha256"):
        load_packed(ds_copy, verify=True)


def test_a_bad_label_names_file_and_pack(tmp_path):
    rows = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (10, 20, 30, 40)]
    src = write_jsonl(rows, tmp_path / "lab.jsonl")
    cfg = BuildConfig(input=str(src), tokenizer=None, pack_size=64, targets="labels")
    out = build_packed(cfg, tmp_path / "lab", progress=False).path
    name = json.loads((out / "metadata.json").read_text())["files"][0]["path"]

    def flip(values):
        values[2] = -7

    rewrite_data_file(out / name, "labels", flip)
    with pytest.raises(NotPackedError, match=rf"^{out / name}: pack 0 \(pack 0 of the dataset\).*'labels'.*token 2 has -7"):
        load_packed(out)[0]


@pytest.mark.parametrize("edit, what", [
    (lambda v: v.__setitem__(0, v[0] + 1), r"'seq_lens' sum to \d+ but 'input_ids' has \d+ tokens"),
    (lambda v: v.__setitem__(0, -3), "seq_lens"),
])
def test_bad_seq_lens_are_found_when_opening(ds_copy, edit, what):
    name = json.loads((ds_copy / "metadata.json").read_text())["files"][0]["path"]
    rewrite_data_file(ds_copy / name, "seq_lens", edit)
    with pytest.raises(NotPackedError, match=rf"^{ds_copy / name}: pack 0 .*{what}"):
        load_packed(ds_copy)


def shift_offsets(col, j: int, by: int):
    """``col`` with the end of its list ``j`` (the start of list ``j + 1``) moved by ``by``."""
    offsets = col.offsets.to_numpy().copy()
    offsets[j + 1] += by
    return pa.ListArray.from_arrays(pa.array(offsets), col.values)


@pytest.mark.parametrize("column, by, what", [
    ("loss_mask", 1, "pack 1 .*'loss_mask' and 'input_ids' have different lengths"),
    ("sample_start", -1, "pack 1 .*'sample_start' and 'seq_lens' have different lengths"),
    ("seq_lens", -10**6, "pack 1 .*'seq_lens' has broken list offsets"),
    ("input_ids", 10**9, "pack 1 .*'input_ids' has broken list offsets"),
])
def test_damaged_list_offsets_are_found_when_opening(ds_copy, column, by, what):
    name = json.loads((ds_copy / "metadata.json").read_text())["files"][0]["path"]
    rewrite_column(ds_copy / name, column, lambda col: shift_offsets(col, 1, by))
    with pytest.raises(NotPackedError, match=rf"^{ds_copy / name}: {what}"):
        load_packed(ds_copy)


def test_a_pack_without_samples_is_found_when_opening(ds_copy):
    name = json.loads((ds_copy / "metadata.json").read_text())["files"][0]["path"]

    def empty_pack_2(col):
        offsets = col.offsets.to_numpy().copy()
        offsets[3] = offsets[2]  # pack 2's samples go to pack 3
        return pa.ListArray.from_arrays(pa.array(offsets), col.values)

    for column in ("seq_lens", "sample_index", "sample_start"):
        rewrite_column(ds_copy / name, column, empty_pack_2)
    with pytest.raises(NotPackedError, match=rf"^{ds_copy / name}: pack 2 .*has no samples"):
        load_packed(ds_copy)


@pytest.mark.parametrize("command", ["stats", "inspect"])
def test_cli_prints_one_line_naming_the_key(ds_copy, capsys, command):
    edit_meta(ds_copy, lambda m: m.update(pack_size="4096"))
    assert main([command, str(ds_copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"thdpack {command}: error: {ds_copy / 'metadata.json'}: 'pack_size' must be an integer")
    assert "\n" not in err


@pytest.mark.parametrize("command", ["stats", "inspect"])
def test_cli_prints_one_line_naming_a_damaged_data_file(ds_copy, capsys, command):
    name = json.loads((ds_copy / "metadata.json").read_text())["files"][0]["path"]
    zero_header(ds_copy / name)
    assert main([command, str(ds_copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"thdpack {command}: error: {ds_copy / name}: not a valid Arrow stream (")
    assert "\n" not in err


def test_errors_are_offline_errors(ds_copy):
    edit_meta(ds_copy, lambda m: m.pop("files"))
    with pytest.raises(OfflineError):
        load_packed(ds_copy)


def test_a_pack_index_out_of_range_names_the_index_given(built):
    """``ds[-n - 1]`` said "pack -1 out of range" (the index after adding n), now the one the caller gave
    (issue 21 point 6); negative indices count from the end."""
    ds = load_packed(built)
    n = len(ds)
    for k in (n, -n - 1, n + 5):
        with pytest.raises(IndexError, match=rf"^pack must be an integer in \[-{n}, {n}\), got {k} \(the dataset has "
                                             rf"{n} packs; a negative pack counts from the end\)$"):
            ds[k]
    assert ds[-n]["input_ids"].tolist() == ds[0]["input_ids"].tolist()
