"""The map function of the build's tokenizing step: :class:`RowTokenizer`, raw rows to token ids
and targets (text, chat through Hugging Face chat templates, prompt/completion, preference, or
already tokenized rows); :func:`thdpack.offline.tokenizing.tokenize_step.tokenize_source` runs it with
``datasets.map``. Every input row (two for preference rows) gives one output row with

- ``input_ids``: int32 token ids;
- ``loss_mask`` (bool, 1 = the token is a target) or ``labels`` (int32, HF style,
  -100 = no loss), as ``targets`` says;
- ``__error__`` (:data:`ERROR_COLUMN`): null, or why the row could not be used (its tokens are then empty).

A failing row never stops the batch: errors are collected per row and reported
with the row's file and line by the caller.

Chat rows: the loss covers the assistant turns (``loss="assistant"``), only the last
one (``"last_assistant"``) or everything (``"all"``). The trained text is the
conversation as the template renders it once (with the row's ``tools``, if any).
Assistant tokens are the ``{% generation %}`` spans when the template has them;
otherwise each assistant turn is located in that one render, from after its role
header through its end-of-turn token (:mod:`thdpack.offline.tokenizing.chat_spans`).
"""

from __future__ import annotations

import json
import re

import numpy as np

from thdpack.offline.tokenizing.chat_content import flatten_content
from thdpack.offline.tokenizing.chat_spans import (TemplateNotSupported, assistant_spans, template_failed, turn_marks,
                                        with_sentinels)
from thdpack.offline.errors import ConfigError, InputError
from thdpack.offline.stage_options import TokenizeOptions
from thdpack.offline.tokenizing.chat_render import normalize_chats, render_chats, role_renders
from thdpack.offline.tokenizing.fastenc import encode_chat, encode_texts, encode_with_spans
from thdpack.offline.tokenizing.row_formats import row_format
from thdpack.offline.store.schema import GROUP_COLUMN, VALUE_COLUMN, VALUE_IS_INT_COLUMN
from thdpack.offline.tokenizing.row_conversions import brief as _brief, encode_prompt_completion, group_key, sample_value
from thdpack.offline.inputs.sources import JSON_COLUMN, NESTED_TOO_DEEP
from thdpack.offline.tokenizing.tiktoken_bpe import FastTokenizerMismatch
from thdpack.offline.tokenizing.tokenizer_loading import has_generation_markers
from thdpack.common.samples import IGNORE_INDEX

ERROR_COLUMN = "__error__"
# int64 per tokenized row: its target tokens after its first (a whole row planned as one piece has exactly
# these in its pack: the planner reads them here instead of the targets themselves; 0 for failed rows)
TAIL_TARGETS_COLUMN = "__tail_targets__"
TOOLS_FIELD = "tools"  # a chat row's tool schemas, passed to the template as ``tools``


class RowTokenizer:
    """``datasets.map`` function (batched, Arrow format): raw rows -> tokens, targets, errors.

    ``fmt`` names the row format (:mod:`thdpack.offline.tokenizing.row_formats`); what differs between
    formats (fields, the value encoded, its encoder, tools, sequences per row) is asked of it; ``opts``
    (:class:`~thdpack.offline.stage_options.TokenizeOptions`) holds the build's tokenizing options."""

    def __init__(self, fmt: str, opts: TokenizeOptions, tokenizer, columns: list[str], bpe=None):
        self.fmt = fmt
        self.format = row_format(fmt)
        self.tok = tokenizer
        self.bpe = bpe  # a TiktokenBPE of ``tokenizer`` (thdpack/offline/tokenizing/tiktoken_bpe.py), or None
        self.json_rows = columns == [JSON_COLUMN]
        self.fields = self.format.fields(opts)
        self.field = self.fields[0]
        self.loss = opts.loss
        self.append_eos = opts.append_eos
        self.targets = opts.targets
        self.value_names = list(opts.value_columns)  # sample_values: numbers carried with each row's samples
        self.group_column = opts.group_column  # group_column: the rows of a group planned into one pack
        self.vocab_size = len(tokenizer) if tokenizer is not None else None
        self.has_generation = False
        self.roles: dict = {}  # role -> whether the chat template renders it (role_renders), asked once each
        if self.format.chat_template:
            template = getattr(tokenizer, "chat_template", None)
            if not template:
                raise ConfigError(f"tokenizer {opts.tokenizer!r} has no chat template; chat rows need one")
            self.has_generation = has_generation_markers(template)
            self.marks = None if self.has_generation or opts.loss == "all" else _turn_marks(tokenizer)
        if self.format.appends_eos and opts.append_eos and tokenizer.eos_token_id is None:
            raise ConfigError(f"tokenizer {opts.tokenizer!r} has no EOS token; set append_eos: false")

    # ---- entry point
    def __call__(self, table):
        values, errors = self._extract(table)
        media = self._media(table, values, errors)
        tools = self._row_tools(table, errors)
        numbers = self._sample_values(table, errors)
        # a preference row gives two sequences, written as two output rows
        values, errors, tools, numbers = self.format.sequences(values, errors, tools, numbers)
        n = len(values)
        ids: list = [None] * n
        targets: list = [None] * n
        ok = [i for i in range(n) if errors[i] is None]
        if ok:
            try:
                results = self._encode_many([values[i] for i in ok], [tools[i] for i in ok])
            except FastTokenizerMismatch:  # not a row's fault: the build tokenizes again without tiktoken
                raise
            except Exception:  # one row broke the batch: redo row by row to blame it
                results = []
                for i in ok:
                    try:
                        results.append(self._encode_many([values[i]], [tools[i]])[0])
                    except FastTokenizerMismatch:
                        raise
                    except Exception as exc:  # noqa: BLE001 - reported as a row error
                        results.append(surrogate_error(values[i], self.field) or row_error(exc))
            for i, res in zip(ok, results):
                if isinstance(res, str):
                    errors[i] = res
                    continue
                ids[i], targets[i] = res
                if ids[i].size == 0:
                    errors[i] = "tokenizes to 0 tokens"
        return self._with_values(self._to_table(ids, targets, errors, media), numbers, errors)

    def _media(self, table, values: list, errors: list):
        """Per-batch inputs besides the text, handed as a value from step 1 to step 3
        (:meth:`_to_table`): none for text rows; the VLM row tokenizer's images and videos
        (it may expand ``values`` and set ``errors`` in place)."""
        return None

    # ---- 1. field values out of the rows
    def _extract(self, table) -> tuple[list, list]:
        """``(values, errors)`` of the batch's rows: what :meth:`RowFormat.value` makes of each row's
        field value (or mapping of fields), None where ``errors`` has the row's error."""
        n = table.num_rows
        errors: list = [None] * n
        if self.json_rows:
            values = self._json_values(table.column(JSON_COLUMN).to_pylist(), errors)
        else:
            values = self._column_values(table)
        messages = self._template_messages
        for i, v in enumerate(values):
            if errors[i] is None:
                try:  # ours: the message names the field, the turn, the message and part
                    values[i] = self.format.value(v, self.field, messages)
                except ValueError as exc:
                    errors[i] = str(exc)
        return values, errors

    def _json_values(self, lines: list, errors: list) -> list:
        """The field values of JSON lines (bytes): the row's mapping with :attr:`RowFormat.whole_row`, else
        the value of its field; None and an error in ``errors`` for a line that is not a JSON object with
        the format's fields."""
        values = []
        for i, line in enumerate(lines):
            try:
                obj = json.loads(line.rstrip(b" \t\r\n"))  # a line's value may end in newlines (jsonl.py)
            except json.JSONDecodeError as exc:
                errors[i] = f"invalid JSON ({exc})"
                values.append(None)
                continue
            except UnicodeDecodeError as exc:
                errors[i] = (f"not UTF-8: byte {exc.object[exc.start]:#04x} at column {exc.start + 1}; convert the "
                             "file to UTF-8")
                values.append(None)
                continue
            except RecursionError:  # json's C parser stops at Python's recursion limit
                errors[i] = f"invalid JSON ({NESTED_TOO_DEEP})"
                values.append(None)
                continue
            if not isinstance(obj, dict):
                errors[i] = f"expected a JSON object, got {type(obj).__name__}"
            elif missing := [f for f in self.fields if f not in obj]:
                errors[i] = f"no '{missing[0]}' field (fields: {sorted(obj)})"
            values.append(None if errors[i] is not None else obj if self.format.whole_row else obj[self.field])
        return values

    def _column_values(self, table) -> list:
        """The field values of a table's rows, as :meth:`_json_values`; InputError naming a missing column."""
        missing = [f for f in self.fields if f not in table.column_names]
        if missing:
            raise InputError(f"the input has no '{missing[0]}' column (columns: {table.column_names})")
        if not self.format.whole_row:
            return table.column(self.field).to_pylist()
        names = [c for c in self.fields + list(self.format.optional_fields) if c in table.column_names]
        cols = {c: table.column(c).to_pylist() for c in names}
        return [{c: cols[c][i] for c in names} for i in range(table.num_rows)]

    def _chat_messages(self, messages: list) -> list:
        """The messages the template renders: content parts joined into strings
        (:func:`flatten_content`); an image part is a row error in a text build."""
        return flatten_content(messages)

    def _template_messages(self, messages: list) -> list:
        """:meth:`_chat_messages`, and a ValueError (the row's error) for a message whose role the chat
        template renders as nothing (:func:`role_renders`): it would be lost from the pack without a word."""
        messages = self._chat_messages(messages)
        for j, m in enumerate(messages):
            role = m.get("role")
            if role not in self.roles:
                self.roles[role] = role_renders(self.tok, role)
            if not self.roles[role]:
                raise ValueError(f"message {j} has role {role!r}, which the chat template renders as nothing (the "
                                 "message would be lost from the pack); use a role it renders (user, assistant, "
                                 "system, tool) or remove the message")
        return messages

    # ---- 2. encode
    def _row_tools(self, table, errors) -> list:
        """Each chat row's ``tools`` (a list of tool schemas, or its JSON text), None where it has
        none; a row whose ``tools`` is neither gets an error."""
        n = table.num_rows
        if not self.format.tools:
            return [None] * n
        if self.json_rows:  # parse again only the lines that mention the field
            key = f'"{TOOLS_FIELD}"'.encode()
            raw = table.column(JSON_COLUMN).to_pylist()
            tools = [json.loads(line).get(TOOLS_FIELD) if errors[i] is None and key in line else None
                     for i, line in enumerate(raw)]
        elif TOOLS_FIELD in table.column_names:
            tools = table.column(TOOLS_FIELD).to_pylist()
        else:
            return [None] * n
        for i, t in enumerate(tools):
            tools[i], msg = _parse_tools(t)
            if msg and errors[i] is None:
                errors[i] = msg
        return tools

    def _sample_values(self, table, errors) -> list:
        """Each row's ``{name: (number, is_integer)}`` of the ``sample_values`` and, with
        ``group_column``, ``{GROUP_COLUMN: key}`` (None where the row failed); a row with a missing or
        wrong value gets an error."""
        n = table.num_rows
        names = self.value_names + ([self.group_column] if self.group_column else [])
        if not names:
            return [None] * n
        if self.json_rows:
            raw = table.column(JSON_COLUMN).to_pylist()
            rows = [json.loads(line) if errors[i] is None else None for i, line in enumerate(raw)]
        else:  # tokenize_source checked the columns
            cols = {c: table.column(c).to_pylist() for c in names}
            rows = [{c: cols[c][i] for c in names} for i in range(n)]
        out: list = [None] * n
        for i, row in enumerate(rows):
            if errors[i] is None:
                try:
                    out[i] = {c: sample_value(row.get(c), c) for c in self.value_names}
                    if self.group_column:
                        out[i][GROUP_COLUMN] = group_key(row.get(self.group_column), self.group_column)
                except ValueError as exc:
                    errors[i] = str(exc)
        return out

    def _encode_many(self, values: list, tools: list) -> list:
        """``[(ids, targets) or error]`` of the rows' values, by the format's encoder (:meth:`RowFormat.encode`)."""
        return self.format.encode(self, values, tools)

    def encode_text_rows(self, texts: list[str]) -> list:
        """``[(input_ids int32 [T], targets bool [T])]`` of text rows: every token a target, EOS appended
        with ``append_eos`` unless the text ends with it."""
        enc = encode_texts(self.tok, texts, self.bpe)  # == self.tok(texts)["input_ids"], faster (fastenc.py)
        eos = self.tok.eos_token_id
        out = []
        for ids in enc:
            arr = np.asarray(ids, dtype=np.int32)
            if self.append_eos and (not arr.size or arr[-1] != eos):
                arr = np.append(arr, np.int32(eos))
            out.append((arr, np.ones(arr.size, dtype=bool)))
        return out

    def encode_chat_rows(self, convs: list, tools: list | None = None) -> list:
        """``[(input_ids int32 [T], targets bool [T]) or error]`` of conversations (``tools``: each one's tool
        schemas or None), the targets as ``loss`` says."""
        if self.loss == "all":  # == apply_chat_template(convs, tokenize=True): render, then encode without specials
            texts = render_chats(self.tok, normalize_chats(convs), False, tools)
            enc = encode_texts(self.tok, texts, self.bpe, add_special_tokens=False)
            return [(np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=bool)) for ids in enc]
        if self.has_generation:
            # == apply_chat_template(..., return_assistant_tokens_mask=True), faster
            enc = encode_chat(self.tok, convs, self.bpe, tools)
            out = []
            for ids, mask in zip(enc["input_ids"], enc["assistant_masks"]):
                mask = np.asarray(mask, dtype=bool)
                if self.loss == "last_assistant":
                    mask = _last_run(mask)
                out.append((np.asarray(ids, dtype=np.int32), mask))
            return out
        return self._encode_chat_by_spans(convs, tools)

    def _encode_chat_by_spans(self, convs, tools=None):
        """Templates without ``{% generation %}``: each conversation is rendered once and each
        assistant turn's character span located in that text, with one more render of it where
        the assistant messages are replaced (:mod:`thdpack.offline.tokenizing.chat_spans`); the tokens
        overlapping a span are targets."""
        convs = normalize_chats(convs)
        tools = tools if tools is not None else [None] * len(convs)
        turns = [[k for k, m in enumerate(conv) if m.get("role") == "assistant"] for conv in convs]
        fulls = render_chats(self.tok, convs, False, tools)
        some = [i for i, t in enumerate(turns) if t]
        variants = dict(zip(some, self._render_variants([convs[i] for i in some], [tools[i] for i in some])))
        rows: list = []
        for i, text in enumerate(fulls):
            try:
                variant = variants.get(i, "")
                if isinstance(variant, TemplateNotSupported):
                    raise variant
                spans = assistant_spans(text, variant, turns[i], self.marks)
            except TemplateNotSupported as exc:
                rows.append(str(exc))
                continue
            rows.append((text, spans[-1:] if self.loss == "last_assistant" else spans))
        good = [i for i, r in enumerate(rows) if not isinstance(r, str)]
        encoded = encode_with_spans(self.tok, [rows[i][0] for i in good], [rows[i][1] for i in good], self.bpe)
        for i, res in zip(good, encoded):
            rows[i] = res
        return rows

    def _render_variants(self, convs, tools) -> list:
        """Each conversation rendered with its assistant messages replaced
        (:func:`~thdpack.offline.tokenizing.chat_spans.with_sentinels`); a TemplateNotSupported for one the
        template refuses so (it renders the conversation itself)."""
        convs = [with_sentinels(c) for c in convs]
        try:
            return render_chats(self.tok, convs, False, tools)
        except Exception:  # noqa: BLE001 - one conversation broke the batch: render one by one to blame it
            out: list = []
            for conv, row_tools in zip(convs, tools):
                try:
                    out.extend(render_chats(self.tok, [conv], False, [row_tools]))
                except Exception as exc:  # noqa: BLE001 - the template's own error, in the row's message
                    out.append(template_failed("the conversation with its assistant messages replaced by a "
                                               "placeholder", row_error(exc)))
            return out

    def encode_completion_rows(self, rows: list, tools: list) -> list:
        """``[(input_ids int32 [T], targets bool [T])]`` of PromptCompletion values (a preference row's
        chosen and rejected sequences each one), as TRL tokenizes them
        (:func:`~thdpack.offline.tokenizing.row_conversions.encode_prompt_completion`)."""
        return encode_prompt_completion(self.tok, rows, self.bpe, tools=tools, loss=self.loss,
                                        append_eos=self.append_eos)

    def encode_tokenized_rows(self, rows: list) -> list:
        """``[(input_ids int32 [T], targets) or error]`` of already tokenized rows (:meth:`_encode_tokenized`)."""
        return [self._encode_tokenized(row) for row in rows]

    def _encode_tokenized(self, row):
        try:
            ids = np.asarray(row["input_ids"])
        except (ValueError, TypeError) as exc:
            return f"'input_ids' is not a list of integers ({exc})"
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            return f"'input_ids' must be a flat list of integers, got {_brief(row['input_ids'])}"
        ids = ids.astype(np.int64)
        if ids.size and ids.min() < 0:
            return f"'input_ids' has negative id {int(ids.min())}"
        if self.vocab_size is not None and ids.size and ids.max() >= self.vocab_size:
            return f"'input_ids' has id {int(ids.max())}, outside the tokenizer's vocabulary ({self.vocab_size})"
        labels, mask = row.get("labels"), row.get("loss_mask")
        if labels is not None and mask is not None:
            return "has both 'labels' and 'loss_mask'; keep one"
        if labels is not None:
            lab = np.asarray(labels)
            if lab.shape != ids.shape or (lab.size and lab.dtype.kind not in "iu"):
                return f"'labels' must be {ids.size} integers like 'input_ids', got {_brief(labels)}"
            bad = (lab != IGNORE_INDEX) & (lab < 0)
            if bad.any():
                return f"'labels' has {int(lab[bad][0])} at token {int(np.argmax(bad))}; use token ids or {IGNORE_INDEX}"
            target = lab != IGNORE_INDEX
            if self.targets == "loss_mask":
                differs = target & (lab != ids)
                if differs.any():
                    t = int(np.argmax(differs))
                    return (
                        f"'labels' differ from 'input_ids' at token {t} ({int(lab[t])} vs {int(ids[t])}); "
                        "a loss mask cannot store that: set targets: labels"
                    )
            return ids.astype(np.int32), (target if self.targets == "loss_mask" else lab.astype(np.int32))
        if mask is not None:
            m = np.asarray(mask)
            if m.shape != ids.shape or (m.size and not np.isin(m, (0, 1)).all()):
                return f"'loss_mask' must be {ids.size} values of 0/1 like 'input_ids', got {_brief(mask)}"
            return ids.astype(np.int32), m.astype(bool)
        return ids.astype(np.int32), np.ones(ids.size, dtype=bool)

    # ---- 3. Arrow output
    def _to_table(self, ids, targets, errors, media=None):
        """The batch's Arrow table: ``input_ids`` / targets as lists and the row errors
        (``media``: what :meth:`_media` returned; unused for text rows)."""
        import pyarrow as pa

        good = [i for i, e in enumerate(errors) if e is None]
        lengths = np.zeros(len(ids), dtype=np.int64)
        lengths[good] = [ids[i].size for i in good]
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        flat_ids = np.concatenate([np.zeros(0, np.int32)] + [ids[i] for i in good])
        if self.targets == "loss_mask":
            parts = [np.asarray(targets[i], dtype=bool) for i in good]
            flat_t, arrow_type = np.concatenate([np.zeros(0, bool)] + parts), pa.bool_()
        else:  # labels: from a mask (text, chat, tokenized loss_mask), labels are the ids where it is set
            parts = [np.where(targets[i], ids[i], IGNORE_INDEX) if targets[i].dtype == bool else targets[i] for i in good]
            flat_t, arrow_type = np.concatenate([np.zeros(0, np.int32)] + parts).astype(np.int32), pa.int32()
        return pa.table(
            {
                "input_ids": pa.ListArray.from_arrays(offsets, pa.array(flat_ids, pa.int32())),
                self.targets: pa.ListArray.from_arrays(offsets, pa.array(flat_t, arrow_type)),
                ERROR_COLUMN: pa.array(errors, pa.string()),
                TAIL_TARGETS_COLUMN: pa.array(_tail_targets(flat_t, lengths), pa.int64()),
            }
        )

    def _with_values(self, table, numbers, errors):
        """``table`` with the columns of the ``sample_values`` (:data:`VALUE_COLUMN`, NaN / False on failed rows)."""
        import pyarrow as pa

        for c in self.value_names:
            got = [numbers[i][c] if errors[i] is None else (float("nan"), False) for i in range(len(errors))]
            table = table.append_column(VALUE_COLUMN.format(c), pa.array([v for v, _ in got], pa.float64()))
            table = table.append_column(VALUE_IS_INT_COLUMN.format(c), pa.array([k for _, k in got], pa.bool_()))
        if self.group_column:
            keys = [numbers[i][GROUP_COLUMN] if errors[i] is None else None for i in range(len(errors))]
            table = table.append_column(GROUP_COLUMN, pa.array(keys, pa.string()))
        return table


def _tail_targets(flat_targets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int64 ``[rows]``: each row's target tokens after its first (:data:`TAIL_TARGETS_COLUMN`), from the
    rows' concatenated targets (bool, or labels with ``IGNORE_INDEX``) and their lengths (int64 ``[rows]``)."""
    is_target = flat_targets if flat_targets.dtype == bool else flat_targets != IGNORE_INDEX
    c = np.zeros(is_target.size + 1, np.int64)
    np.cumsum(is_target, out=c[1:])
    end = np.cumsum(lengths)
    start = np.minimum(end - lengths + 1, end)  # after the first token (an empty row: nothing)
    return c[end] - c[start]


def _turn_marks(tok):
    """The header and end-of-turn text of ``tok``'s chat template (:func:`~thdpack.offline.tokenizing.chat_spans.turn_marks`);
    a ConfigError naming the option to use when the template cannot be handled."""
    special = [t.content for t in tok.added_tokens_decoder.values() if t.special]

    def render(convs, add_generation_prompt):
        return [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt) for c in convs]

    try:
        return turn_marks(render, special)
    except TemplateNotSupported as exc:
        raise ConfigError(f"loss: assistant / last_assistant: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the template's own error, in the message
        raise ConfigError(f"loss: assistant / last_assistant: "
                          f"{template_failed('a two-message probe conversation', row_error(exc))}") from None


def _parse_tools(value) -> tuple[list | None, str | None]:
    """``(tools, error)``: a row's ``tools`` value as the list of schemas the template gets
    (None for none); a JSON string is parsed. ``error`` says what is wrong, else None."""
    tools = value
    if isinstance(value, str):
        try:
            tools = json.loads(value) if value.strip() else None
        except json.JSONDecodeError:
            tools = value
    if tools is None or (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return tools, None
    return None, (f"'{TOOLS_FIELD}' must be a list of tool schemas (JSON objects) or the JSON text of one, "
                  f"got {_brief(value)}")


def _last_run(mask: np.ndarray) -> np.ndarray:
    """Only the last contiguous run of True (the last assistant turn)."""
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return mask
    end = idx[-1]
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    out = np.zeros_like(mask)
    out[start : end + 1] = True
    return out


def row_error(exc: Exception) -> str:
    """A row's error message for an exception its tokenizing raised: the type and the first line, at most 500 characters."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}"[:500]


_SURROGATE = re.compile("[\ud800-\udfff]")


def surrogate_error(value, field: str) -> str | None:
    """The row error for a value holding a lone surrogate (a JSON ``"\\ud800"`` escape with no pair: a
    Python string, but no Unicode text a tokenizer encodes), naming where in ``field`` (or in the whole
    row, a mapping or dataclass) it is; None when there is none. Asked only of a row whose encoding failed."""
    try:
        found = _find_surrogate(value, [])
    except RecursionError:
        return None
    if found is None:
        return None
    path, char = found
    if isinstance(value, dict) or hasattr(value, "__dataclass_fields__"):  # a whole row: its first key is the field
        field, path = path[0], path[1:]
    where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)
    return (f"'{field}'{where} holds a lone surrogate {char!r} (an unpaired \\uD800-\\uDFFF escape): not valid "
            "Unicode text; fix or remove it")


def _find_surrogate(value, path: list):
    """``(path, character)`` of the first lone surrogate in the strings of ``value`` (nested lists,
    mappings and dataclasses; ``path``: the keys and indices down to it), or None."""
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        return (path, m.group()) if m else None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    elif hasattr(value, "__dataclass_fields__"):
        items = [(k, getattr(value, k)) for k in value.__dataclass_fields__]
    else:
        return None
    for key, v in items:
        found = _find_surrogate(v, path + [key])
        if found is not None:
            return found
    return None
