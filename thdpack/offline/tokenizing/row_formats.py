"""Row formats as registered classes: adding a row format is adding a class that calls :func:`register_format`
and its name to :data:`thdpack.offline.stage_options.FORMATS`.

Each class says what a row of its format has and what the build does with it; the row tokenizer
(:class:`~thdpack.offline.tokenizing.row_tokenizer.RowTokenizer`) and the tokenizing step ask the
format object (:func:`row_format`), never compare names:

===================  ==========================  ==========  =====  =============  ===========================
format               fields                      sequences   tools  chat template  value encoded
===================  ==========================  ==========  =====  =============  ===========================
chat                 ``messages_field``          1           yes    needed         the messages, parts joined
sharegpt             ``conversations``           1           yes    needed         its turns as messages
prompt_completion    ``prompt``, ``completion``  1           yes    for messages   a PromptCompletion
preference           ``prompt``, ``chosen``,     2           yes    for messages   (chosen, rejected)
                     ``rejected``
text                 ``text_field``              1           no     no             the string
tokenized            ``input_ids``               1           no     no             the row's fields
===================  ==========================  ==========  =====  =============  ===========================

Each class's name is one of ``BuildConfig.format``'s choices after ``auto``
(:data:`thdpack.offline.stage_options.FORMATS`, hence ``--format``'s; a test keeps the two in step); ``format: auto`` takes the
first format of :data:`DETECTION_ORDER` whose fields a row has (:func:`detect_format`). The row-level
conversions the classes call (ShareGPT turns, prompt/completion pairs) are in
:mod:`thdpack.offline.tokenizing.row_conversions`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from thdpack.offline.stage_options import FORMATS
from thdpack.offline.stage_options import TokenizeOptions
from thdpack.offline.tokenizing.row_conversions import (CHOSEN_FIELD, COMPLETION_FIELD, PROMPT_FIELD, REJECTED_FIELD,
                                                    SHAREGPT_FIELD, SYSTEM_FIELD, check_messages, preference_row,
                                                    prompt_completion, sharegpt_row)

ROW_FORMATS: dict[str, "RowFormat"] = {}  # name -> the registered format object (register_format)

# the order ``format: auto`` tries; the first format whose fields a row has wins (a preference row
# has a prompt too; a tokenized row may keep its text)
DETECTION_ORDER = ("chat", "sharegpt", "preference", "prompt_completion", "tokenized", "text")

Messages = Callable[[list], list]  # the row tokenizer's preparation of a list of messages (content parts joined)


def register_format(cls: type) -> type:
    """Class decorator: register one ``cls()`` under ``cls.name``, which must be one of ``BuildConfig.format``'s
    choices (:data:`thdpack.offline.stage_options.FORMATS`, where a new format's name is added); ValueError otherwise."""
    if cls.name not in FORMATS[1:]:
        raise ValueError(f"row format {cls.name!r} is not a choice of 'format': add its name to FORMATS in "
                         "thdpack/offline/stage_options.py")
    ROW_FORMATS[cls.name] = cls()
    return cls


def row_format(name: str) -> "RowFormat":
    """The registered format called ``name``; ValueError naming the known ones for any other name."""
    try:
        return ROW_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown row format {name!r}; use one of {', '.join(ROW_FORMATS)}") from None


def detect_format(columns, opts: TokenizeOptions) -> str | None:
    """The name of the first format of :data:`DETECTION_ORDER` whose fields are all in ``columns``; None if none."""
    cols = set(columns)
    for name in DETECTION_ORDER:
        if all(f in cols for f in ROW_FORMATS[name].fields(opts)):
            return name
    return None


class RowFormat:
    """One row format: its fields and what a row of it gives. Subclasses set the class attributes,
    :meth:`fields`, :meth:`value` and :meth:`encode`, and are registered with :func:`register_format`."""

    name: str = ""
    optional_fields: tuple[str, ...] = ()  # read when present, besides :meth:`fields`
    sequences_per_row: int = 1  # tokenized sequences one input row gives (kept in one pack)
    tools: bool = False  # the row's ``tools`` (tool schemas) go to the chat template, as in TRL
    chat_template: bool = False  # the rows are messages built through the chat template: the tokenizer needs one
    whole_row: bool = False  # the value is the row's mapping of fields (:meth:`fields` and optional), not one field's
    appends_eos: bool = False  # ``append_eos`` ends each sequence with the tokenizer's EOS (which must exist)
    needs_tokenizer: bool = True  # the rows are text to tokenize (not already token ids)
    images_refused: str | None = None  # why rows of this format cannot carry images; None: they can

    def fields(self, opts: TokenizeOptions) -> list[str]:
        """The fields a row must have (``opts`` names the chat and text fields)."""
        raise NotImplementedError

    def value(self, v, field: str, messages: Messages):
        """What is encoded of a row's value ``v`` (the first field's value, ``field``, or the row's mapping
        with :attr:`whole_row`); ``messages`` prepares a list of messages for the template. Raises
        ValueError with the row's error (naming the field) for a value that cannot be built."""
        raise NotImplementedError

    def encode(self, rows, values: list, tools: list) -> list:
        """``[(input_ids int32 [T], targets bool [T] or int32 [T]) or error string]`` of the :meth:`value` s
        ``values`` (``tools``: each one's tool schemas or None), by the encoder of the row tokenizer ``rows``."""
        raise NotImplementedError

    def sequences(self, values: list, errors: list, *per_row: list) -> tuple[list, ...]:
        """The batch's lists per input row -> per tokenized sequence, ``(values, errors, *per_row)``: with
        ``k`` :attr:`sequences_per_row`, ``values[i]`` (``k`` values where ``errors[i]`` is None) becomes
        sequences ``k*i`` to ``k*i + k - 1``; a row's error and its entry of every ``per_row`` list (tools,
        sample values) go to each of them. With ``k == 1``, the lists as they are."""
        k = self.sequences_per_row
        if k == 1:
            return (values, errors, *per_row)
        seqs = [v for group, e in zip(values, errors) for v in (group if e is None else (None,) * k)]
        return (seqs, *([x for x in column for _ in range(k)] for column in (errors, *per_row)))

    def sequence_rows(self, num_sequences: int) -> np.ndarray:
        """int64 ``[num_sequences]``: the input row of each tokenized sequence (:attr:`sequences_per_row` per row)."""
        return np.arange(num_sequences, dtype=np.int64) // self.sequences_per_row


@register_format
class ChatFormat(RowFormat):
    """OpenAI ``messages`` rows, rendered with the chat template; the loss on the assistant turns (``loss``)."""

    name = "chat"
    tools = True
    chat_template = True

    def fields(self, opts):
        return [opts.messages_field]

    def value(self, v, field, messages):
        msg = check_messages(v, field)
        if msg:
            raise ValueError(msg)
        return messages(v)

    def encode(self, rows, values, tools):
        return rows.encode_chat_rows(values, tools)


@register_format
class ShareGptFormat(ChatFormat):
    """``{"conversations": [{"from": "human", "value": ...}, ...], "system": ...}``: the turns become
    messages (:func:`~thdpack.offline.tokenizing.row_conversions.sharegpt_row`), then built as a chat row."""

    name = "sharegpt"
    optional_fields = (SYSTEM_FIELD,)
    whole_row = True

    def fields(self, opts):
        return [SHAREGPT_FIELD]

    def value(self, v, field, messages):
        return super().value(sharegpt_row(v), field, messages)


@register_format
class PromptCompletionFormat(RowFormat):
    """TRL's ``{"prompt": ..., "completion": ...}`` rows (strings or lists of messages); the completion is trained."""

    name = "prompt_completion"
    tools = True
    whole_row = True
    appends_eos = True

    @property
    def images_refused(self) -> str:
        return f"rows with images must be chat (messages or sharegpt) or text rows, not {self.name}"

    def fields(self, opts):
        return [PROMPT_FIELD, COMPLETION_FIELD]

    def value(self, v, field, messages):
        return prompt_completion(v, messages)

    def encode(self, rows, values, tools):
        return rows.encode_completion_rows(values, tools)


@register_format
class PreferenceFormat(PromptCompletionFormat):
    """TRL's DPO rows ``{"prompt": ..., "chosen": ..., "rejected": ...}``: two sequences per row, prompt +
    chosen then prompt + rejected, each encoded as a prompt/completion row (the layout ``dpo_loss`` reads)."""

    name = "preference"
    sequences_per_row = 2

    def fields(self, opts):
        return [PROMPT_FIELD, CHOSEN_FIELD, REJECTED_FIELD]

    def value(self, v, field, messages):
        return preference_row(v, messages)


@register_format
class TextFormat(RowFormat):
    """``{"text": ...}`` rows (``text_field``): every token is trained."""

    name = "text"
    appends_eos = True

    def fields(self, opts):
        return [opts.text_field]

    def value(self, v, field, messages):
        if not isinstance(v, str):
            raise ValueError(f"'{field}' must be a string, got {type(v).__name__}")
        if not v:
            raise ValueError(f"'{field}' is empty")
        return v

    def encode(self, rows, values, tools):
        return rows.encode_text_rows(values)


@register_format
class TokenizedFormat(RowFormat):
    """Already tokenized rows: ``input_ids`` and optionally ``labels`` or ``loss_mask``."""

    name = "tokenized"
    optional_fields = ("labels", "loss_mask")
    whole_row = True
    needs_tokenizer = False
    images_refused = ("rows with images must be chat or text rows: the image placeholders are expanded "
                      "before tokenizing (already tokenized VLM rows are not supported)")

    def fields(self, opts):
        return ["input_ids"]

    def value(self, v, field, messages):
        if v.get("input_ids") is None:
            raise ValueError("'input_ids' is null")
        return v

    def encode(self, rows, values, tools):
        return rows.encode_tokenized_rows(values)
