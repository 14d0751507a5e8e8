"""What every fast tokenizing path shares: it checks itself once per process and tokenizer, on the
first :data:`CHECK_ROWS` rows, against the ``transformers`` call it stands for, and keeps the answer
(:func:`decided`); calls that carry tool schemas are made per group of rows with the same tools
(:func:`per_tools`, as ``apply_chat_template`` takes one ``tools`` per call)."""

from __future__ import annotations

import json

CHECK_ROWS = 32
LATER = object()  # a decision the first rows could not make: decide on a later call


def decided(cache: dict, key, tok, decide):
    """What ``decide()`` said the first time for tokenizer ``tok`` in this process (kept in
    ``cache[key]`` next to ``tok``, so a new tokenizer that reuses an id decides again);
    ``LATER`` is not kept."""
    entry = cache.get(key)
    if entry is None or entry[0] is not tok:
        value = decide()
        if value is LATER:
            return LATER
        cache[key] = entry = (tok, value)
    return entry[1]


def per_tools(conversations: list, tools: list | None, fn) -> list:
    """``fn(convs, kw)`` on each group of conversations with the same tools (``kw``: ``{"tools": t}``,
    or ``{}`` for none; ``apply_chat_template`` takes one ``tools`` per call), results put back
    in the conversations' order."""
    if tools is None or all(t is None for t in tools):
        return list(fn(conversations, {}))
    groups: dict = {}
    for i, t in enumerate(tools):
        key = None if t is None else json.dumps(t, sort_keys=True, default=str)
        groups.setdefault(key, (t, []))[1].append(i)
    out: list = [None] * len(conversations)
    for t, rows in groups.values():
        for i, res in zip(rows, fn([conversations[i] for i in rows], {} if t is None else {"tools": t})):
            out[i] = res
    return out
