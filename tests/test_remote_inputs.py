"""Inputs named by a filesystem URI (fsspec): ``memory://`` stands for a remote store here (the same
code path as ``s3://`` / ``gs://``, with no network). The packs must be the bytes a build of the same
files from local paths writes; the rows are named by their URIs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import fsspec
import pytest

from thdpack.cli import main

ROOT = Path(__file__).resolve().parent.parent
TOK = str(ROOT / "thdpack" / "demo" / "tokenizer")
COMMON = ["--tokenizer", TOK, "--format", "text", "--pack-size", "256", "-q"]


def _rows(n: int, seed: int) -> list[dict]:
    return [{"text": f"row {seed}-{i}: " + "the quick brown fox " * (1 + (i * 7 + seed) % 9)} for i in range(n)]


@pytest.fixture
def remote(tmp_path):
    """Two JSON Lines files and a Parquet file in fsspec's in-memory filesystem under a fresh prefix, with
    local copies of the same bytes in ``tmp_path / "local"``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs = fsspec.filesystem("memory")
    prefix = f"/thdpack-test-{tmp_path.name}"
    local = tmp_path / "local"
    local.mkdir()
    for name, seed in (("a.jsonl", 1), ("b.jsonl", 2)):
        data = "\n".join(json.dumps(r) for r in _rows(120, seed)).encode()
        fs.pipe(f"{prefix}/rows/{name}", data)
        (local / name).write_bytes(data)
    pq.write_table(pa.table({"text": [r["text"] for r in _rows(80, 3)]}), local / "c.parquet")
    fs.pipe(f"{prefix}/table/c.parquet", (local / "c.parquet").read_bytes())
    yield f"memory://{prefix}", local
    fs.rm(prefix, recursive=True)


def _data_digests(out: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
            if p.is_file() and p.name != "metadata.json"}


def _metadata(out: Path) -> dict:
    return json.loads((out / "metadata.json").read_text())


@pytest.mark.parametrize("given, local_given", [
    ("{uri}/rows/*.jsonl", "{local}/*.jsonl"),   # a glob
    ("{uri}/rows", "{local}"),                    # a directory: every file under it (the .parquet left out below)
    ("{uri}/table/c.parquet", "{local}/c.parquet"),
])
def test_a_uri_input_builds_the_packs_of_the_same_local_files(given, local_given, remote, tmp_path):
    uri, local = remote
    if given.endswith("/rows"):
        (local / "c.parquet").unlink()
    assert main(["build", "--input", given.format(uri=uri), *COMMON, "--output", str(tmp_path / "r")]) == 0
    assert main(["build", "--input", local_given.format(local=local), *COMMON, "--output", str(tmp_path / "l")]) == 0
    assert _data_digests(tmp_path / "r") == _data_digests(tmp_path / "l")
    on_remote, on_disk = _metadata(tmp_path / "r")["source"], _metadata(tmp_path / "l")["source"]
    assert on_remote["fingerprint"] == on_disk["fingerprint"]  # named by the bytes, not the location
    assert all(f["path"].startswith("memory://") for f in on_remote["files"])
    assert [f["sha256"] for f in on_remote["files"]] == [f["sha256"] for f in on_disk["files"]]
    assert not (tmp_path / "r" / "_work").exists()  # the fetched copies left with the build's temporary files


def test_a_bad_row_of_a_uri_input_is_named_by_its_uri(remote, tmp_path, capsys):
    uri, _ = remote
    fsspec.filesystem("memory").pipe(uri.removeprefix("memory://") + "/bad/x.jsonl", b'{"text": "ok"}\n{not json\n')
    assert main(["build", "--input", f"{uri}/bad/x.jsonl", *COMMON, "--output", str(tmp_path / "o")]) != 0
    assert f"{uri}/bad/x.jsonl:2" in capsys.readouterr().err


def test_a_save_to_disk_directory_by_uri(remote, tmp_path):
    import datasets

    uri, _ = remote
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(_rows(90, 4)).save_to_disk(str(saved))
    fs = fsspec.filesystem("memory")
    for p in saved.iterdir():
        fs.pipe(f"{uri.removeprefix('memory://')}/saved/{p.name}", p.read_bytes())
    assert main(["build", "--input", f"{uri}/saved", *COMMON, "--output", str(tmp_path / "r")]) == 0
    assert main(["build", "--input", str(saved), *COMMON, "--output", str(tmp_path / "l")]) == 0
    assert _data_digests(tmp_path / "r") == _data_digests(tmp_path / "l")


def test_a_file_uri_is_read_in_place(remote, tmp_path):
    _, local = remote
    assert main(["build", "--input", f"file://{local}/a.jsonl", *COMMON, "--output", str(tmp_path / "r")]) == 0
    assert main(["build", "--input", str(local / "a.jsonl"), *COMMON, "--output", str(tmp_path / "l")]) == 0
    assert _data_digests(tmp_path / "r") == _data_digests(tmp_path / "l")
    assert _metadata(tmp_path / "r")["source"]["files"][0]["path"] == f"file://{local}/a.jsonl"


@pytest.mark.parametrize("given, message", [
    ("nosuchproto://bucket/a.jsonl", "cannot open its filesystem: Protocol not known: nosuchproto"),
    ("s3://bucket/a.jsonl", "cannot open its filesystem: Install s3fs"),
    ("{uri}/missing.jsonl", "does not exist"),
    ("{uri}/rows/*.parquet", "matches no .jsonl/.json/.parquet/.arrow file"),
    ("{uri}/rows/a.csv", "does not exist"),
])
def test_a_bad_uri_is_one_line(given, message, remote, tmp_path, capsys):
    uri, _ = remote
    given = given.format(uri=uri)
    assert main(["build", "--input", given, *COMMON, "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
