"""Inputs named by a filesystem URI (``s3://``, ``gs://``, ``hf://``, ``abfs://``, ``memory://``, ...):
expanded and fetched with `fsspec <https://filesystem-spec.readthedocs.io>`_ into the build's work
directory, then read as local files.

A URI is a file, a directory (every supported file under it, in sorted order, or a ``save_to_disk``
directory) or a glob, as a local path is. The rows are named in messages and ``metadata.json`` by
their URIs, and fingerprinted by their bytes, so a build of a copy of the same files on another
filesystem has the same fingerprint. The protocol's fsspec package must be installed (``s3fs``,
``gcsfs``, ``adlfs``, ...; credentials as that package reads them). ``file://`` URIs are read in
place. Fetching into the work directory (inside the output's staging directory) keeps the rows where
every node of an ``engine: ray`` cluster reads them, and removes them with the build's other
temporary files.
"""

from __future__ import annotations

import glob
from pathlib import Path, PurePosixPath

from thdpack.offline.errors import ConfigError, InputError

_SAVED_MARKERS = ("state.json", "dataset_dict.json")


def filesystem(spec: str):
    """``(fs, path)`` of URI ``spec`` (an fsspec filesystem and the path in it); a one-line ConfigError
    when the protocol is unknown or its package is missing."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(spec)
    except (ImportError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"input {spec!r}: cannot open its filesystem: {first}") from None


def is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def fetch(spec: str, into: Path, supported) -> list[tuple[str, Path]]:
    """``[(uri, local path)]`` of the input files URI ``spec`` names, each copied under directory
    ``into`` (created); ``supported(name)`` says which file names are rows. A ``save_to_disk``
    directory is copied whole and is the only entry."""
    fs, path = filesystem(spec)
    found = _remote_files(spec, fs, path, supported)
    if found is None:  # a save_to_disk directory
        local = into / "0" / PurePosixPath(path.rstrip("/")).name
        _get(spec, fs, path, local, recursive=True)
        return [(spec, local)]
    out = []
    for k, remote in enumerate(found):
        local = into / str(k) / PurePosixPath(remote).name  # one directory each: equal names stay apart
        _get(spec, fs, remote, local)
        out.append((fs.unstrip_protocol(remote) if len(found) > 1 or remote != path else spec, local))
    return out


def _remote_files(spec: str, fs, path: str, supported) -> list[str] | None:
    """The row files URI ``spec`` names (sorted), or None for a ``save_to_disk`` directory."""
    try:
        if glob.has_magic(path):
            found = sorted(p for p in fs.glob(path) if fs.isfile(p) and supported(p))
            if not found:
                raise InputError(f"input pattern {spec!r} matches no .jsonl/.json/.parquet/.arrow file")
            return found
        if not fs.exists(path):
            raise InputError(f"input {spec!r} does not exist")
        if not fs.isdir(path):
            if not supported(path):
                raise InputError(f"input {spec!r}: unsupported file type; expected .jsonl/.json/.parquet/.arrow")
            return [path]
        if any(fs.isfile(f"{path.rstrip('/')}/{m}") for m in _SAVED_MARKERS):
            return None
        found = sorted(p for p in fs.find(path) if supported(p))
    except OSError as exc:
        raise InputError(f"cannot read {spec}: {exc}") from None
    if not found:
        raise InputError(f"input directory {spec!r} has no .jsonl/.json/.parquet/.arrow file and is not a "
                         "save_to_disk dataset")
    return found


def _get(spec: str, fs, remote: str, local: Path, recursive: bool = False) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    try:
        if recursive:
            fs.get(remote.rstrip("/") + "/", str(local), recursive=True)
        else:
            fs.get_file(remote, str(local))
    except OSError as exc:
        raise InputError(f"cannot read {fs.unstrip_protocol(remote)} (input {spec!r}): {exc}") from None
