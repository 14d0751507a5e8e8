"""Messages that name the real fault (issue 21 point 6): a file the command cannot *read* is named as
one (not "cannot write OUT"), an unreadable data file is not "damaged", a directory without
``metadata.json`` is not a packed dataset (not "inputs mix JSON with arrow files"), a row that is not
a pack names the missing field, and a pad id outside the vocabulary is refused where it is read
(``metadata.json``, ``thdpack export --pad-id``). Each: one line, exit 2 on the command line,
nothing left behind.

Unreadable files are real: ``chmod 000``, and a root process (which may read anything) drops
``CAP_DAC_OVERRIDE`` and ``CAP_DAC_READ_SEARCH`` from its effective capabilities for the test
(:func:`unreadable`), as a process of an ordinary user would have none.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("pyarrow")

from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline import BuildConfig, NotPackedError, build_packed, load_packed, unpack_row  # noqa: E402
from thdpack.offline.commands.bridge_export import export_bridge  # noqa: E402
from thdpack.offline.errors import ConfigError, ReadError  # noqa: E402
from thdpack.offline.inputs.input_slice import InputSlice  # noqa: E402
from thdpack.offline.commands.slice_merge import merge_slices  # noqa: E402

TEXT = ["--format", "text", "--tokenizer", str(TOKENIZER_DIR), "--pack-size", "1024", "--overflow", "truncate", "-q"]
VOCAB = 3072  # the bundled demo tokenizer's


# ---------------------------------------------------------------------------- unreadable files


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_CAP_V3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3
_READ_ANYTHING = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


@contextlib.contextmanager
def _without_read_anything():
    """This thread without the capabilities that let root read any file (Linux; skipped elsewhere)."""
    if os.geteuid() != 0:
        yield
        return
    if not sys.platform.startswith("linux"):
        pytest.skip("root reads every file here, and dropping that needs Linux capabilities")
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(_CAP_V3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        pytest.skip("capget failed")
    before = data[0].effective
    data[0].effective &= ~_READ_ANYTHING
    if libc.capset(ctypes.byref(header), data) != 0:
        pytest.skip("capset failed: cannot drop root's read-anything capabilities")
    try:
        yield
    finally:
        data[0].effective = before
        assert libc.capset(ctypes.byref(header), data) == 0


@contextlib.contextmanager
def unreadable(*paths: Path):
    """``paths`` unreadable (mode 000) by this process within the block."""
    modes = [p.stat().st_mode for p in paths]
    for p in paths:
        p.chmod(0)
    try:
        with _without_read_anything():
            with pytest.raises(PermissionError):
                if paths[0].is_dir():
                    list(paths[0].iterdir())
                else:
                    paths[0].open("rb").close()
            yield
    finally:
        for p, mode in zip(paths, modes):
            p.chmod(mode)


def _error_line(err: str, command: str) -> str:
    """The one stderr line of a failed command (no traceback, no second line)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"thdpack {command}: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """Text rows, a packed dataset of them, and their two input slices."""
    d = tmp_path_factory.mktemp("messages")
    src = write_jsonl(generate_rows(60, seed=4, kind="text"), d / "rows.jsonl")
    cfg = BuildConfig(input=str(src), format="text", tokenizer=str(TOKENIZER_DIR), pack_size=1024, overflow="truncate")
    packed = build_packed(cfg, d / "packed", progress=False).path
    slices = [build_packed(cfg, d / "parts" / f"{i}", progress=False, input_slice=InputSlice(i, 2)).path
              for i in range(2)]
    return {"src": src, "packed": packed, "slices": slices, "dir": d}


@pytest.fixture
def copy_of(tmp_path):
    """A fresh copy of a directory (the test may damage it)."""

    def copy(path: Path, name: str = "copy") -> Path:
        return Path(shutil.copytree(path, tmp_path / name))

    return copy


def test_an_unreadable_input_is_named_as_one_not_as_the_output(inputs, tmp_path, capsys):
    src = tmp_path / "rows.jsonl"
    shutil.copy(inputs["src"], src)
    out = tmp_path / "o" / "out"
    with unreadable(src):
        assert main(["build", "--input", str(src), *TEXT, "--output", str(out)]) == 2
    line = _error_line(capsys.readouterr().err, "build")
    assert f"cannot read {src}: Permission denied" in line and "fix its permissions" in line, line
    assert "cannot write" not in line and "choose another --output" not in line, line
    assert list(out.parent.iterdir()) == []  # no output, no temporary directory, no lock file


def test_an_unreadable_input_directory_is_named(inputs, tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(inputs["src"], d / "rows.jsonl")
    out = tmp_path / "o" / "out"
    with unreadable(d):
        assert main(["build", "--input", str(d), *TEXT, "--output", str(out)]) == 2
    line = _error_line(capsys.readouterr().err, "build")
    assert f"cannot read {d}" in line and "Permission denied" in line and "cannot write" not in line, line
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("what", ["directory", "tokenizer.json"])
def test_an_unreadable_tokenizer_is_named_as_one(inputs, tmp_path, capsys, what):
    tok = Path(shutil.copytree(TOKENIZER_DIR, tmp_path / "tok"))
    out = tmp_path / "o" / "out"
    flags = [a if a != str(TOKENIZER_DIR) else str(tok) for a in TEXT]
    with unreadable(tok if what == "directory" else tok / "tokenizer.json"):
        assert main(["build", "--input", str(inputs["src"]), *flags, "--output", str(out)]) == 2
    line = _error_line(capsys.readouterr().err, "build")
    assert str(tok) in line and "tokenizer.json" in line and "Permission denied" in line, line
    assert "cannot write" not in line, line
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_an_unwritable_output_is_still_named_as_the_output(inputs, tmp_path, capsys):
    """The neighbour: what the build writes is reported as a write (its output, its parent)."""
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with _without_read_anything():
            assert main(["build", "--input", str(inputs["src"]), *TEXT, "--output", str(parent / "out")]) == 2
    finally:
        parent.chmod(0o755)
    line = _error_line(capsys.readouterr().err, "build")
    assert f"cannot write {parent / 'out'}: " in line and "no permission to write there" in line, line


@pytest.mark.parametrize("what", ["data file", "metadata.json", "saved tokenizer"])
def test_an_unreadable_slice_is_named_as_one(inputs, tmp_path, copy_of, capsys, what):
    """``thdpack merge`` of a slice whose data file, metadata.json or saved tokenizer copy cannot be read
    (the tokenizer copy was one ``shutil.Error`` of every failure, printed as a list)."""
    slices = [copy_of(p, f"s{i}") for i, p in enumerate(inputs["slices"])]
    bad = {"data file": next(slices[1].glob("data-*.arrow")), "metadata.json": slices[1] / "metadata.json",
           "saved tokenizer": slices[0] / "tokenizer" / "tokenizer.json"}[what]
    out = tmp_path / "o" / "merged"
    with unreadable(bad):
        assert main(["merge", str(out), *map(str, slices), "-q"]) == 2
    line = _error_line(capsys.readouterr().err, "merge")
    assert f"cannot read {bad}: Permission denied; no permission to read it" in line, line
    assert "cannot write" not in line, line
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
    with unreadable(bad), pytest.raises(ReadError, match=f"cannot read {bad}: "):
        merge_slices(slices, out)


def test_an_unreadable_data_file_is_not_damaged(inputs, copy_of, tmp_path, capsys):
    """``thdpack stats`` / ``export`` / ``load_packed`` of a dataset whose data file this process may not
    read: say so, not "the dataset is damaged: rebuild it"."""
    ds = copy_of(inputs["packed"])
    data = next(ds.glob("data-*.arrow"))
    with unreadable(data):
        assert main(["stats", str(ds)]) == 2
        line = _error_line(capsys.readouterr().err, "stats")
        assert main(["export", str(ds), "--to", "megatron-bridge", str(tmp_path / "bridge")]) == 2
        export_line = _error_line(capsys.readouterr().err, "export")
        with pytest.raises(ReadError, match=f"cannot read {data}: Permission denied"):
            load_packed(ds)
    for text in (line, export_line):
        assert f"cannot read {data}: Permission denied; no permission to read it" in text, text
        assert "damaged" not in text and "rebuild" not in text, text
    assert not (tmp_path / "bridge").exists()


def test_an_unreadable_metadata_json_is_named(inputs, copy_of, capsys):
    ds = copy_of(inputs["packed"])
    with unreadable(ds / "metadata.json"):
        assert main(["stats", str(ds)]) == 2
        assert main(["inspect", str(ds)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(f"cannot read {ds / 'metadata.json'}: Permission denied" in line for line in err), err


def test_a_damaged_data_file_is_still_damaged(inputs, copy_of, capsys):
    """The neighbour: a data file that is readable but not Arrow keeps the damaged / rebuild advice."""
    ds = copy_of(inputs["packed"])
    data = next(ds.glob("data-*.arrow"))
    size = data.stat().st_size
    data.write_bytes(b"\0" * size)  # same size: found only when read
    assert main(["stats", str(ds)]) == 2
    line = _error_line(capsys.readouterr().err, "stats")
    assert f"{data}: not a valid Arrow stream" in line and "the dataset is damaged" in line, line


# ---------------------------------------------------------------------------- a directory that is not a packed dataset


def test_stats_of_a_directory_without_metadata_json(inputs, copy_of, capsys):
    """A packed dataset whose metadata.json is gone (an interrupted build, a removed file): was "inputs mix
    JSON with ['arrow'] files; build them separately" (the tokenizer copy's JSON beside the data files)."""
    ds = copy_of(inputs["packed"])
    (ds / "metadata.json").unlink()
    for flags in ([], ["--tokenizer", str(TOKENIZER_DIR), "--pack-size", "1024"]):
        assert main(["stats", str(ds), *flags]) == 2
        line = _error_line(capsys.readouterr().err, "stats")
        assert f"{ds} is not a packed dataset: it holds data files of one but no metadata.json" in line, line
        assert "thdpack build" in line and "thdpack stats DATA.jsonl --tokenizer" in line, line
    shutil.rmtree(ds / "tokenizer")  # the data files alone: was planned as tokenized raw input, exit 0
    assert main(["stats", str(ds)]) == 2
    assert "is not a packed dataset" in _error_line(capsys.readouterr().err, "stats")


def test_stats_of_raw_input_directories_is_unchanged(inputs, tmp_path, capsys):
    """The neighbours: a directory of JSON Lines is still raw input, an empty one still says what it lacks."""
    raw = tmp_path / "raw"
    raw.mkdir()
    shutil.copy(inputs["src"], raw / "rows.jsonl")
    assert main(["stats", str(raw), "--format", "text", "--tokenizer", str(TOKENIZER_DIR), "--pack-size", "1024",
                 "--overflow", "truncate", "-q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 60
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["stats", str(empty)]) == 2
    assert "has no .jsonl/.json/.parquet/.arrow file" in _error_line(capsys.readouterr().err, "stats")


# ---------------------------------------------------------------------------- a row that is not a pack


def test_the_packed_row_collator_names_a_row_that_is_not_a_pack(inputs):
    """Was a raw ``KeyError: 'seq_lens'``."""
    ds = load_packed(inputs["packed"])
    collate = ds.collator()
    sample = {"input_ids": np.arange(5), "labels": np.arange(5)}  # a sample, not a pack
    with pytest.raises(ValueError, match=r"^packed row 0 has no 'seq_lens', 'sample_index': it is not a pack\. "
                                         r"A pack \(a row of load_packed\) holds input_ids, seq_lens, sample_index"):
        collate([sample])
    with pytest.raises(ValueError, match=r"^packed row 1 has no 'sample_index': it is not a pack.*collate plain "
                                         r"samples with thdpack\.ThdCollator"):
        collate([ds[0], {k: v for k, v in ds[0].items() if k != "sample_index"}])
    with pytest.raises(ValueError, match=r"^packed row 0 has no 'seq_lens', 'sample_index'"):
        collate(sample)  # one row, not a list
    with pytest.raises(TypeError, match=r"^packed row 0 must be a mapping \(a row of load_packed\), got list"):
        collate([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"^packed row has no 'seq_lens': it is not a pack"):
        unpack_row(sample)
    assert collate([ds[0], ds[1]]).cu_seqlens.numel() > 2  # the neighbour: packs still collate


def test_the_sample_collator_names_a_pack_given_as_a_sample(inputs):
    """thdpack.ThdCollator given a pack: was "'sample_index' must be an integer >= 0, got array([...])",
    or, without sample_index, one sample of the whole pack."""
    import thdpack
    from thdpack.common.samples import SampleError

    pack = load_packed(inputs["packed"])[0]
    for row in (pack, {k: v for k, v in pack.items() if k != "sample_index"}):
        with pytest.raises(SampleError, match=r"^sample 1 is a pack \(a row of load_packed: it has 'seq_lens'\), not a "
                                              r"sample; collate packs with PackedDataset\.collator\(\)"):
            thdpack.ThdCollator()([{"input_ids": [1, 2, 3]}, row])
    assert thdpack.ThdCollator()(unpack_row(pack)).cu_seqlens.numel() == pack["seq_lens"].size + 1


# ---------------------------------------------------------------------------- pad ids outside the vocabulary


def _edit_tokenizer(ds: Path, **values) -> None:
    meta = json.loads((ds / "metadata.json").read_text())
    meta["tokenizer"].update(values)
    (ds / "metadata.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("key, value", [("pad_token_id", VOCAB), ("pad_token_id", 10**6), ("eos_token_id", VOCAB + 5),
                                        ("bos_token_id", 2**40)])
def test_a_special_id_outside_the_vocabulary_in_metadata_is_refused(inputs, copy_of, capsys, key, value):
    """Was accepted by ``thdpack stats`` and ``load_packed`` (and padded batches with it)."""
    ds = copy_of(inputs["packed"])
    _edit_tokenizer(ds, **{key: value})
    want = (f"{ds / 'metadata.json'}: 'tokenizer.{key}' must be an integer in [0, {VOCAB}), got {value} (a token id "
            "of the tokenizer.vocab_size ids, or null); rebuild the dataset")
    with pytest.raises(NotPackedError, match=re.escape(want)):
        load_packed(ds)
    assert main(["stats", str(ds)]) == 2
    assert want in _error_line(capsys.readouterr().err, "stats")


@pytest.mark.parametrize("value", [-1, True, "0", 1.5])
def test_a_special_id_that_is_not_a_token_id_is_refused(inputs, copy_of, value):
    ds = copy_of(inputs["packed"])
    _edit_tokenizer(ds, eos_token_id=value)
    want = rf"'tokenizer\.eos_token_id' must be an integer in \[0, {VOCAB}\), got {value!r} \(a token id of the "
    with pytest.raises(NotPackedError, match=want + r"tokenizer\.vocab_size ids, or null\); rebuild"):
        load_packed(ds)


def test_special_ids_within_the_vocabulary_are_accepted(inputs, copy_of):
    ds = copy_of(inputs["packed"])
    _edit_tokenizer(ds, pad_token_id=VOCAB - 1, eos_token_id=None, bos_token_id=0)
    assert len(load_packed(ds)) == len(load_packed(inputs["packed"]))


def test_export_refuses_a_pad_id_bridge_cannot_hold(inputs, tmp_path, capsys):
    """``--pad-id 2**31`` was an OverflowError traceback from numpy; a pad id outside the vocabulary was
    written into every pre-padded pack."""
    src = inputs["packed"]
    out = tmp_path / "bridge"
    cases = {
        str(2**31): "pad_id must be an integer in [0, 2147483648), got 2147483648 (the tokenizer's EOS id, which Bridge "
                    "pads with; Bridge's input_ids are int32)",
        str(2**70): "pad_id must be an integer in [0, 2147483648), got 1180591620717411303424",
        "999999": f"pad_id 999999 is outside the tokenizer's vocabulary of {VOCAB} ids recorded in {src / 'metadata.json'}: "
                  f"give an id in 0..{VOCAB - 1}",
        str(VOCAB): f"pad_id {VOCAB} is outside the tokenizer's vocabulary",
        "-1": "pad_id must be an integer in [0, 2147483648), got -1",
    }
    for pad, want in cases.items():
        assert main(["export", str(src), "--to", "megatron-bridge", str(out), "--pad-id", pad, "--pad-seq-to-mult", "2"]) == 2
        line = _error_line(capsys.readouterr().err, "export")
        assert want in line, (pad, line)
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"^pad_id must be an integer in \[0, 2147483648\), got 2147483648 "):
        export_bridge(src, out, pad_id=2**31)
    with pytest.raises(ConfigError, match=r"pad_id 4000 is outside the tokenizer's vocabulary"):
        export_bridge(src, out, pad_id=4000, pad_seq_to_mult=2)
    record = export_bridge(src, out, pad_id=VOCAB - 1, pad_seq_to_mult=2)  # the neighbour: the last id is one
    assert record["pad_id"] == VOCAB - 1

