"""Rows to token ids and targets: text, chat (Hugging Face chat templates) or already tokenized.

:func:`tokenize_source` runs :class:`RowTokenizer` over the raw rows with
``datasets.map`` (batched, ``num_proc`` processes, results memory-mapped in a work
directory). Every input row gives one output row with

- ``input_ids``: int32 token ids;
- ``loss_mask`` (bool, 1 = the token is a target) or ``labels`` (int32, HF style,
  -100 = no loss), as ``targets`` says;
- ``__error__``: null, or why the row could not be used (its tokens are then empty).

A failing row never stops the batch: errors are collected per row and reported
with the row's file and line by the caller.

Chat rows: the loss covers the assistant turns (``loss="assistant"``), only the last
one (``"last_assistant"``) or everything (``"all"``). The trained text is the
conversation as the template renders it once (with the row's ``tools``, if any).
Assistant tokens are the ``{% generation %}`` spans when the template has them;
otherwise each assistant turn is located in that one render, from after its role
header through its end-of-turn token (:mod:`thdpack.offline.chat_spans`).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import numpy as np

from thdpack.offline.chat_spans import (TemplateNotSupported, assistant_spans, template_failed, turn_marks,
                                        with_sentinels)
from thdpack.offline.config import BuildConfig
from thdpack.offline.errors import ConfigError, InputError
from thdpack.offline.fastenc import encode_chat, encode_texts, encode_with_spans, normalize_chats, render_chats
from thdpack.offline.format import bytes_sha256
from thdpack.offline.procs import map_in_processes
from thdpack.offline.row_formats import (CHAT_FORMATS, DETECTION_ORDER, PAIR_FORMATS, TOOLS_FORMATS,
                                         WHOLE_ROW_FORMATS, brief as _brief, check_messages, detect_format,
                                         encode_prompt_completion, format_fields, optional_fields, pair_sequences,
                                         preference_row, prompt_completion, sample_value, sharegpt_row,
                                         group_key, GROUP_COLUMN, VALUE_COLUMN, VALUE_IS_INT_COLUMN)
from thdpack.offline.sources import JSON_COLUMN, Source
from thdpack.offline.mmap_input import memory_mapped
from thdpack.offline.tiktoken_bpe import FastTokenizerMismatch, TiktokenBPE
from thdpack.samples import IGNORE_INDEX

ERROR_COLUMN = "__error__"
TOOLS_FIELD = "tools"  # a chat row's tool schemas, passed to the template as ``tools``
logger = logging.getLogger(__name__)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


# ---------------------------------------------------------------------------- tokenizer


def load_tokenizer(cfg: BuildConfig):
    """``AutoTokenizer`` for ``cfg.tokenizer``, from a local directory or the local HF cache only."""
    from transformers import AutoTokenizer

    spec = cfg.tokenizer
    local = cfg.resolve_path(spec)
    target = str(local) if local.exists() else spec
    if not local.exists() and (spec.startswith((".", "/", "~")) or spec.count("/") > 1):
        raise InputError(f"tokenizer {spec!r}: no such directory ({local})")
    try:
        tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    except (OSError, ValueError) as exc:
        from huggingface_hub.constants import HF_HUB_CACHE

        if local.exists():
            raise InputError(f"tokenizer {spec!r}: cannot load {local} ({exc})") from None
        raise InputError(
            f"tokenizer {spec!r} was not found offline: it is not a local directory "
            f"(relative paths in a config file are relative to the file) and not in the Hugging Face "
            f"cache ({HF_HUB_CACHE}). thdpack never downloads; fetch it once with "
            f"`hf download {spec}` or give a local path."
        ) from None
    if cfg.chat_template:
        tok.chat_template = read_chat_template(cfg)
    return tok


def read_chat_template(cfg: BuildConfig) -> str:
    """The text of ``cfg.chat_template`` (a file; relative to the config file)."""
    path = cfg.resolve_path(cfg.chat_template)
    if not path.is_file():
        raise ConfigError(f"chat_template {cfg.chat_template!r}: no such file ({path})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"chat_template {cfg.chat_template!r}: cannot read {path} ({exc})") from None
    try:
        from jinja2 import TemplateSyntaxError
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(text)
    except ImportError:
        pass
    except TemplateSyntaxError as exc:
        raise ConfigError(f"chat_template {path}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    return text


def tokenizer_info(tok, spec: str) -> dict:
    """What metadata.json records about the tokenizer (a content fingerprint, not a path)."""
    backend = getattr(tok, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))
    template = getattr(tok, "chat_template", None)
    return {
        "name_or_path": spec,
        "fingerprint": bytes_sha256(vocab + repr(template)),
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        "chat_template_has_generation_markers": bool(template and isinstance(template, str) and _GENERATION_TAG.search(template)),
    }


# ---------------------------------------------------------------------------- format


def resolve_format(cfg: BuildConfig, source: Source) -> str:
    """The row format: ``cfg.format`` or, for ``auto``, the first format of
    :data:`~thdpack.offline.row_formats.DETECTION_ORDER` whose fields the rows have."""
    if cfg.format != "auto":
        return cfg.format
    fmt = detect_format(source.columns, cfg)
    if fmt is None:
        expected = "; ".join(f"{' + '.join(repr(f) for f in format_fields(f, cfg))} ({f})" for f in DETECTION_ORDER)
        raise InputError(
            f"{source.files[0].path}: cannot tell the row format from the fields {sorted(source.columns)}; "
            f"expected {expected}. Set --format and --messages-field / --text-field."
        )
    return fmt


def required_columns(fmt: str, cfg: BuildConfig) -> list[str]:
    return format_fields(fmt, cfg)


# ---------------------------------------------------------------------------- chat content

IMAGE_PART_TYPES = ("image", "image_url")
VIDEO_PART_TYPES = ("video", "video_url")
# Text parts are joined with nothing between them: what the Qwen-VL family's templates
# render (they loop over the parts and print each ``text`` as is) and what their
# processors and the VLM build (vlm.py) give. A separator belongs in the text itself.
TEXT_PART_SEPARATOR = ""


def flatten_content(messages: list, image=None, video=None) -> list:
    """``messages`` (dicts with a ``role``) with every list of content parts (the OpenAI /
    ``transformers`` layout ``[{"type": "text", "text": "hi"}, ...]``) replaced by one
    string: the text parts (or bare strings) in order, joined with :data:`TEXT_PART_SEPARATOR`.
    String and missing / None content stay as they are. ``image(part)`` gives the text an
    image part stands for (the VLM build's placeholder marker); without it an image part
    is an error; ``video(part)`` likewise for video parts. Raises ValueError naming the
    message and part for anything else."""
    out = []
    for j, m in enumerate(messages):
        content = m.get("content")
        if content is None or isinstance(content, str):
            out.append(m)
            continue
        if not isinstance(content, list):
            raise ValueError(f"message {j}: 'content' must be a string or a list of content parts "
                             f"({{\"type\": \"text\", \"text\": ...}}), got {_brief(content)}")
        text = [_part_text(part, j, k, image, video) for k, part in enumerate(content)]
        out.append(dict(m, content=TEXT_PART_SEPARATOR.join(text)))
    return out


def _part_text(part, j: int, k: int, image, video=None) -> str:
    """The text content part ``k`` of message ``j`` stands for (see :func:`flatten_content`)."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f"message {j} part {k}: a text part needs a 'text' string, got {_brief(part)}")
        return part["text"]
    if kind in IMAGE_PART_TYPES:
        if image is None:
            raise ValueError(f"message {j} part {k}: an image part in a text build; give a Qwen-VL "
                             "model_config to build rows with images, or remove the part")
        return image(part)
    if kind in VIDEO_PART_TYPES:
        if video is None:
            raise ValueError(f"message {j} part {k}: a video part in a text build; give a Qwen-VL "
                             "model_config to build rows with videos, or remove the part")
        return video(part)
    if not isinstance(part, dict) or kind is None:
        raise ValueError(f"message {j} part {k}: a content part must be an object with a 'type' "
                         f"('text' or 'image'), got {_brief(part)}")
    raise ValueError(f"message {j} part {k}: part type {kind!r} is not supported (text, image and video parts are)")


# ---------------------------------------------------------------------------- the map function


class RowTokenizer:
    """``datasets.map`` function (batched, Arrow format): raw rows -> tokens, targets, errors."""

    def __init__(self, fmt: str, cfg: BuildConfig, tokenizer, columns: list[str], bpe=None):
        self.fmt = fmt
        self.tok = tokenizer
        self.bpe = bpe  # a TiktokenBPE of ``tokenizer`` (thdpack/offline/tiktoken_bpe.py), or None
        self.json_rows = columns == [JSON_COLUMN]
        self.fields = required_columns(fmt, cfg)
        self.field = self.fields[0]
        self.loss = cfg.loss
        self.append_eos = cfg.append_eos
        self.targets = cfg.targets
        self.value_names = cfg.value_columns()  # sample_values: numbers carried with each row's samples
        self.group_column = cfg.group_column  # group_column: the rows of a group planned into one pack
        self.vocab_size = len(tokenizer) if tokenizer is not None else None
        self.has_generation = False
        if fmt in CHAT_FORMATS:
            template = getattr(tokenizer, "chat_template", None)
            if not template:
                raise ConfigError(f"tokenizer {cfg.tokenizer!r} has no chat template; chat rows need one")
            self.has_generation = isinstance(template, str) and bool(_GENERATION_TAG.search(template))
            self.marks = None if self.has_generation or cfg.loss == "all" else _turn_marks(tokenizer)
        if fmt in ("text", "prompt_completion", "preference") and cfg.append_eos and tokenizer.eos_token_id is None:
            raise ConfigError(f"tokenizer {cfg.tokenizer!r} has no EOS token; set append_eos: false")

    # ---- entry point
    def __call__(self, table):
        n = table.num_rows
        values, errors = self._extract(table)
        media = self._media(table, values, errors)
        tools = self._row_tools(table, errors)
        numbers = self._sample_values(table, errors)
        if self.fmt in PAIR_FORMATS:  # each row gives two sequences, written as two output rows
            values, errors, tools, numbers = pair_sequences(values, errors, tools, numbers)
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
                        results.append(_row_error(exc))
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
    def _extract(self, table):
        n = table.num_rows
        errors: list = [None] * n
        if self.json_rows:
            raw = table.column(JSON_COLUMN).to_pylist()
            rows = []
            for i, line in enumerate(raw):
                try:
                    obj = json.loads(line.rstrip(b" \t\r\n"))  # a line's value may end in newlines (jsonl.py)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    errors[i] = f"invalid JSON ({exc})"
                    rows.append(None)
                    continue
                if not isinstance(obj, dict):
                    errors[i] = f"expected a JSON object, got {type(obj).__name__}"
                    rows.append(None)
                    continue
                rows.append(obj)
            values = []
            for i, obj in enumerate(rows):
                missing = [f for f in self.fields if obj is not None and f not in obj]
                if obj is None:
                    values.append(None)
                elif missing:
                    errors[i] = f"no '{missing[0]}' field (fields: {sorted(obj)})"
                    values.append(None)
                else:
                    values.append(obj if self.fmt in WHOLE_ROW_FORMATS else obj[self.field])
        else:
            missing = [f for f in self.fields if f not in table.column_names]
            if missing:
                raise InputError(f"the input has no '{missing[0]}' column (columns: {table.column_names})")
            if self.fmt in WHOLE_ROW_FORMATS:
                names = [c for c in self.fields + optional_fields(self.fmt) if c in table.column_names]
                cols = {c: table.column(c).to_pylist() for c in names}
                values = [{c: cols[c][i] for c in names} for i in range(n)]
            else:
                values = table.column(self.field).to_pylist()
        for i, v in enumerate(values):
            if errors[i] is None:
                try:  # ShareGPT turns and prompt/completion rows are checked as they are converted
                    if self.fmt == "sharegpt":
                        v = sharegpt_row(v)
                    elif self.fmt == "prompt_completion":
                        values[i] = prompt_completion(v, self._chat_messages)
                        continue
                    elif self.fmt == "preference":
                        values[i] = preference_row(v, self._chat_messages)
                        continue
                except ValueError as exc:  # ours: the message names the field and the turn
                    errors[i] = str(exc)
                    continue
                msg = self._check_value(v)
                if msg:
                    errors[i] = msg
                elif self.fmt in CHAT_FORMATS:
                    try:
                        values[i] = self._chat_messages(v)
                    except ValueError as exc:  # ours: the message names the message and part
                        errors[i] = str(exc)
        return values, errors

    def _chat_messages(self, messages: list) -> list:
        """The messages the template renders: content parts joined into strings
        (:func:`flatten_content`); an image part is a row error in a text build."""
        return flatten_content(messages)

    def _check_value(self, v) -> str | None:
        if self.fmt == "text":
            if not isinstance(v, str):
                return f"'{self.field}' must be a string, got {type(v).__name__}"
            if not v:
                return f"'{self.field}' is empty"
        elif self.fmt in CHAT_FORMATS:
            return check_messages(v, self.field)
        else:
            if v.get("input_ids") is None:
                return "'input_ids' is null"
        return None

    # ---- 2. encode
    def _row_tools(self, table, errors) -> list:
        """Each chat row's ``tools`` (a list of tool schemas, or its JSON text), None where it has
        none; a row whose ``tools`` is neither gets an error."""
        n = table.num_rows
        if self.fmt not in TOOLS_FORMATS:
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

    def _encode_many(self, values: list, tools: list | None = None) -> list:
        if self.fmt == "text":
            return self._encode_text(values)
        if self.fmt in CHAT_FORMATS:
            return self._encode_chat(values, tools)
        if self.fmt in ("prompt_completion", "preference"):  # preference: a chosen / rejected sequence each
            return encode_prompt_completion(self.tok, values, self.bpe, tools=tools, loss=self.loss,
                                            append_eos=self.append_eos)
        return [self._encode_tokenized(v) for v in values]

    def _encode_text(self, texts):
        enc = encode_texts(self.tok, texts, self.bpe)  # == self.tok(texts)["input_ids"], faster (fastenc.py)
        eos = self.tok.eos_token_id
        out = []
        for ids in enc:
            arr = np.asarray(ids, dtype=np.int32)
            if self.append_eos and (not arr.size or arr[-1] != eos):
                arr = np.append(arr, np.int32(eos))
            out.append((arr, np.ones(arr.size, dtype=bool)))
        return out

    def _encode_chat(self, convs, tools=None):
        """``[(ids, mask) or error]`` of conversations (``tools``: each one's tool schemas or None)."""
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
        the assistant messages are replaced (:mod:`thdpack.offline.chat_spans`); the tokens
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
        (:func:`~thdpack.offline.chat_spans.with_sentinels`); a TemplateNotSupported for one the
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
                                               "placeholder", _row_error(exc)))
            return out

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


def _turn_marks(tok):
    """The header and end-of-turn text of ``tok``'s chat template (:func:`~thdpack.offline.chat_spans.turn_marks`);
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
                          f"{template_failed('a two-message probe conversation', _row_error(exc))}") from None


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


def _row_error(exc: Exception) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}"[:500]


# ---------------------------------------------------------------------------- running it


@dataclass
class Tokenized:
    """Tokenized rows (one per input row; two per row, chosen then rejected, for preference rows) and what
    went wrong (indexed like the tokenized rows)."""

    dataset: object  # datasets.Dataset: input_ids, loss_mask|labels, __error__
    lengths: np.ndarray  # int64 [rows]; 0 for failed rows
    errors: list[tuple[int, str]]  # (row, message) of failed rows
    fmt: str
    tokenizer: object | None
    tokenizer_info: dict | None


def fast_bpe(cfg: BuildConfig, tok, fmt: str):
    """The tiktoken form of ``tok`` (:mod:`thdpack.offline.tiktoken_bpe`) when
    ``cfg.tokenizer_backend`` allows it and the tokenizer converts exactly; else None."""
    if tok is None or fmt == "tokenized" or cfg.tokenizer_backend == "hf":
        return None
    bpe, why = TiktokenBPE.from_tokenizer(tok)
    if bpe is None and cfg.tokenizer_backend == "tiktoken":
        raise ConfigError(f"tokenizer_backend: tiktoken, but tokenizer {cfg.tokenizer!r} cannot run on it: {why}")
    logger.info("tokenizer " + ("byte-level BPE through tiktoken (checked against the tokenizer on a sample of rows)"
                                if bpe is not None else f"through transformers ({why})"))
    return bpe


def tokenize_source(cfg: BuildConfig, source: Source, work_dir, *, progress: bool = True, vlm=None) -> Tokenized:
    """Tokenize every row of ``source`` with ``datasets.map`` into ``work_dir``; with ``vlm``
    (a :class:`thdpack.offline.vlm.VlmBuild`) also process the rows' images."""
    import datasets

    fmt = resolve_format(cfg, source)
    if vlm is not None and fmt in ("prompt_completion", "preference"):
        raise ConfigError(f"rows with images must be chat (messages or sharegpt) or text rows, not {fmt}")
    if not source.is_json:
        missing = [c for c in required_columns(fmt, cfg) if c not in source.columns]
        if missing:
            raise InputError(
                f"{source.files[0].path}: no '{missing[0]}' column for format '{fmt}' (columns: {source.columns})"
            )
        missing = [c for c in cfg.value_columns() + [cfg.group_column] if c and c not in source.columns]
        if missing:
            raise InputError(f"{source.files[0].path}: no '{missing[0]}' column, which "
                             f"{'group_column' if missing[0] == cfg.group_column else 'sample_values'} names "
                             f"(columns: {source.columns})")
    tok = None
    if cfg.tokenizer:
        tok = load_tokenizer(cfg)
    elif fmt != "tokenized":
        raise ConfigError(f"format '{fmt}' needs a tokenizer: give --tokenizer or 'tokenizer:' in the config")

    ds = source.dataset
    keep = [JSON_COLUMN] if source.is_json else [c for c in ds.column_names if c in (
        required_columns(fmt, cfg) + optional_fields(fmt)
        + ([TOOLS_FIELD] if fmt in TOOLS_FORMATS else []) + (vlm.input_columns() if vlm is not None else [])
        + cfg.value_columns() + ([cfg.group_column] if cfg.group_column else []))]
    if keep != ds.column_names:
        ds = ds.select_columns(keep)
    bpe = fast_bpe(cfg, tok, fmt)
    target_type = datasets.Value("bool") if cfg.targets == "loss_mask" else datasets.Value("int32")
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            cfg.targets: datasets.List(target_type),
            ERROR_COLUMN: datasets.Value("string"),
            **(vlm.features() if vlm is not None else {}),
            **{col.format(c): datasets.Value(kind) for c in cfg.value_columns()
               for col, kind in ((VALUE_COLUMN, "float64"), (VALUE_IS_INT_COLUMN, "bool"))},
            **({GROUP_COLUMN: datasets.Value("string")} if cfg.group_column else {}),
        }
    )
    fingerprint = bytes_sha256(
        json.dumps([source.fingerprint, fmt, cfg.as_dict(recorded=True), tokenizer_info(tok, "") if tok else None],
                   sort_keys=True, default=str)
    )[:16]

    def row_tokenizer(bpe):
        if vlm is None:
            return RowTokenizer(fmt, cfg, tok, ds.column_names, bpe)
        return vlm.row_tokenizer(fmt, cfg, tok, ds.column_names, source, bpe)

    batch_size = cfg.map_batch_size if vlm is None else vlm.map_batch_size(cfg.map_batch_size)
    num_proc = min(cfg.num_proc, max(1, len(ds) // max(1, batch_size))) if cfg.num_proc > 1 else None
    if num_proc:  # workers map the rows from a file instead of each getting a pickled copy (mmap_input.py)
        ds = memory_mapped(ds, work_dir / "rows.arrow")
    if not progress:
        datasets.disable_progress_bars()
    def tokenize_all(fn):
        kwargs = dict(
            batched=True,
            batch_size=batch_size,
            remove_columns=ds.column_names,
            with_indices=vlm is not None,
            features=features,
            cache_file_name=str(work_dir / "tokenized.arrow"),
            load_from_cache_file=False,
            new_fingerprint=fingerprint,
            desc=f"Tokenizing ({fmt})",
        )
        if num_proc:  # in processes of our own, which signals and errors stop for sure (procs.py)
            return map_in_processes(ds.with_format("arrow"), fn, num_proc, **kwargs).with_format(None)
        return ds.with_format("arrow").map(fn, **kwargs).with_format(None)

    try:
        try:
            out = tokenize_all(row_tokenizer(bpe))
        except FastTokenizerMismatch as exc:
            if bpe is None:
                raise
            logger.info(f"tiktoken  {exc}; tokenizing again with the tokenizer itself")
            out = tokenize_all(row_tokenizer(None))
    finally:
        if not progress:
            datasets.enable_progress_bars()
    col = out.data.table.column("input_ids")
    lengths = np.concatenate(
        [np.diff(np.asarray(c.offsets)).astype(np.int64) for c in col.chunks] or [np.zeros(0, np.int64)]
    )
    err_col = out.data.table.column(ERROR_COLUMN)
    bad = np.flatnonzero(np.asarray(err_col.is_valid()))
    errors = [(int(i), err_col[int(i)].as_py()) for i in bad]
    return Tokenized(out, lengths, errors, fmt, tok, tokenizer_info(tok, cfg.tokenizer) if tok else None)
