"""JSON Lines bytes -> one Arrow binary value per non-blank line, without copying the text.

``raw.split(b"\\n")`` makes a Python ``bytes`` object per line and ``pa.array`` copies
them again: reading a 430 MB file peaked at ~2 GB in the process that then forks the
tokenization workers. Here the lines stay in ``raw``: an Arrow ``large_binary`` array
whose data buffer *is* ``raw`` and whose offsets start at each non-blank line. As Arrow
values are contiguous, a value also holds the newline after its line and any blank
lines up to the next one (leading blank lines go with the first): JSON whitespace,
which ``json.loads`` ignores (the tokenizer strips it before parsing, so messages point
into the line itself).
"""

from __future__ import annotations

import numpy as np

_JSON_WS = b" \t\r\n"
_ASCII_WS = b" \t\r\n\x0b\x0c"  # what bytes.strip() removes: the old reader's notion of a blank line


def split_lines(raw: bytes, limit: int | None = None):
    """``(array, line_numbers)``: a ``pa.large_binary`` array of the non-blank lines of
    ``raw`` (first ``limit`` of them) and their 1-based line numbers (int64), or ``None``
    when a blank line holds a character JSON does not take as whitespace (\\x0b, \\x0c):
    the caller then splits the lines by copying."""
    import pyarrow as pa

    buf = np.frombuffer(raw, dtype=np.uint8)
    n = buf.size
    step = 1 << 24  # find the newlines 16 MiB at a time (no file-sized temporary)
    nl = np.concatenate([np.zeros(0, np.int64)] + [np.flatnonzero(buf[a: a + step] == 10) + a for a in range(0, n, step)])
    starts = np.concatenate([np.zeros(1, np.int64), nl + 1])  # line k is raw[starts[k]:ends[k]]
    ends = np.concatenate([nl, np.array([n], np.int64)])
    lengths = ends - starts
    first = np.full(starts.size, 32, np.uint8)
    nonempty = lengths > 0
    first[nonempty] = buf[starts[nonempty]]
    blank = lengths == 0
    for k in np.flatnonzero(nonempty & np.isin(first, np.frombuffer(_ASCII_WS, np.uint8))).tolist():
        line = bytes(raw[starts[k]: ends[k]])  # starts with whitespace: rare, check it in Python (raw: any buffer)
        if not line.strip(_ASCII_WS):
            if line.strip(_JSON_WS):
                return None
            blank[k] = True
    keep = np.flatnonzero(~blank)
    if limit is not None:
        keep = keep[:limit]
    offsets = np.empty(keep.size + 1, np.int64)
    offsets[:-1] = starts[keep]
    if keep.size:
        offsets[0] = 0  # leading blank lines go with the first line
        nxt = keep[-1] + 1
        offsets[-1] = n if limit is None or nxt >= starts.size else starts[nxt]
    else:
        offsets[-1] = 0
    array = pa.LargeBinaryArray.from_buffers(pa.large_binary(), keep.size, [None, pa.py_buffer(offsets), pa.py_buffer(raw)])
    return array, keep.astype(np.int64) + 1


def json_lines(raw, limit: int | None = None):
    """``(array, line_numbers)``: :func:`split_lines` of ``raw``, or where it declines (a blank line holding
    \\x0b or \\x0c) the same rows copied out line by line (each value the line without its newline)."""
    import pyarrow as pa

    split = split_lines(raw, limit)
    if split is not None:
        return split
    parts = bytes(raw).split(b"\n")
    keep = [i for i, line in enumerate(parts) if line.strip()]
    if limit is not None:
        keep = keep[:limit]
    return pa.array([parts[i] for i in keep], pa.large_binary()), np.asarray(keep, dtype=np.int64) + 1
