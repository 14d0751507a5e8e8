"""The row-level conversions of the row formats besides OpenAI ``messages`` rows: ShareGPT and TRL's
prompt/completion (the format classes that call them: :mod:`thdpack.offline.tokenizing.row_formats`).

Each one becomes the representation the build already has, so that the chat code
(templates, assistant targets) is written once (:mod:`thdpack.offline.tokenizing.row_tokenizer`):

- **sharegpt** ``{"conversations": [{"from": "human", "value": ...}, ...]}``:
  converted to ``messages`` (:func:`sharegpt_to_messages`) and then built exactly
  as a chat row; the roles are mapped as LLaMA-Factory's ``sharegpt`` format
  defines them (:data:`SHAREGPT_ROLES`), its optional ``system`` column put first.
- **prompt_completion** ``{"prompt": ..., "completion": ...}``, both strings or
  both lists of messages: tokenized as TRL's ``SFTTrainer`` does
  (``trl/trainer/sft_trainer.py``, ``tokenize_fn``), the completion's tokens being
  the targets (:func:`encode_prompt_completion`). Rows with images are not taken.
- **preference** ``{"prompt": ..., "chosen": ..., "rejected": ...}`` (TRL's DPO rows), strings or
  lists of messages: two prompt/completion rows sharing the prompt (:func:`preference_row`), so
  one row gives two sequences, the chosen then the rejected one (the layout
  :func:`thdpack.losses.dpo_loss` reads: sequence ``2k`` and ``2k+1`` of input row ``k``).

A ``tools`` column goes to the template for all three, as for chat rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from thdpack.offline.tokenizing.chat_render import normalize_chats, render_chats
from thdpack.offline.tokenizing.fastenc import encode_texts

SHAREGPT_FIELD = "conversations"
SYSTEM_FIELD = "system"  # a ShareGPT row's optional system prompt (LLaMA-Factory's ``system`` column)
PROMPT_FIELD = "prompt"
COMPLETION_FIELD = "completion"
CHOSEN_FIELD = "chosen"
REJECTED_FIELD = "rejected"

# ShareGPT ``from`` -> OpenAI ``role`` (LLaMA-Factory's tags: human, gpt, system, observation,
# function_call; ``user``/``assistant``/``tool`` as TRL's from/value rows and others write them).
# ``function_call`` turns become assistant messages with ``tool_calls`` (:func:`_tool_calls`).
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}


# ---------------------------------------------------------------------------- ShareGPT


def sharegpt_row(row: dict) -> list[dict]:
    """The messages of a ShareGPT row (``conversations`` and an optional ``system`` string):
    :func:`sharegpt_to_messages`, with the ``system`` prompt first unless the first turn is a
    system turn (LLaMA-Factory's rule: the turn wins)."""
    messages = sharegpt_to_messages(row[SHAREGPT_FIELD])
    system = row.get(SYSTEM_FIELD)
    if system is not None and not isinstance(system, str):
        raise ValueError(f"'{SYSTEM_FIELD}' must be a string (the system prompt), got {brief(system)}")
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def sharegpt_to_messages(turns) -> list[dict]:
    """``[{"from": "human", "value": "hi"}, ...]`` -> ``[{"role": "user", "content": "hi"}, ...]``.

    A ``function_call`` turn's value is the call as JSON (``{"name": ..., "arguments": ...}`` or a
    list of them) and becomes ``{"role": "assistant", "content": "", "tool_calls": [...]}``.
    Raises ValueError naming the field, the turn and what to do for anything else."""
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"'{SHAREGPT_FIELD}' must be a non-empty list of turns "
                         f"({{\"from\": \"human\", \"value\": ...}}), got {brief(turns)}")
    return [_sharegpt_message(t, j) for j, t in enumerate(turns)]


def _sharegpt_message(turn, j: int) -> dict:
    where = f"'{SHAREGPT_FIELD}' turn {j}"
    if not isinstance(turn, dict):
        raise ValueError(f"{where} must be an object with 'from' and 'value', got {brief(turn)}")
    for key in ("from", "value"):
        if key not in turn:
            hint = (f"; a turn with 'role'/'content' is a messages row: set messages_field: {SHAREGPT_FIELD} "
                    "and format: chat") if "role" in turn else ""
            raise ValueError(f"{where} has no '{key}' (a ShareGPT turn is "
                             f"{{\"from\": \"human\", \"value\": \"...\"}}){hint}")
    role, value = turn["from"], turn["value"]
    if not isinstance(role, str) or role not in SHAREGPT_ROLES:
        raise ValueError(f"{where}: unknown role {brief(role)} in 'from'; use one of {', '.join(SHAREGPT_ROLES)}")
    if not isinstance(value, str):
        raise ValueError(f"{where}: 'value' must be a string, got {brief(value)}")
    if role == "function_call":
        return {"role": "assistant", "content": "", "tool_calls": _tool_calls(value, where)}
    return {"role": SHAREGPT_ROLES[role], "content": value}


def _tool_calls(value: str, where: str) -> list[dict]:
    """A function_call turn's JSON value as OpenAI ``tool_calls`` (``{"type": "function", "function": ...}``)."""
    try:
        calls = json.loads(value)
    except json.JSONDecodeError:
        calls = None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c
                            for c in calls):
        raise ValueError(f"{where}: a function_call 'value' must be JSON {{\"name\": ..., \"arguments\": ...}} "
                         f"or a list of them, got {brief(value)}")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


# ---------------------------------------------------------------------------- prompt / completion


@dataclass(frozen=True)
class PromptCompletion:
    """One prompt/completion row: two strings, or two lists of messages (content parts already joined)."""

    prompt: str | list
    completion: str | list

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def prompt_completion(row: dict, messages=lambda m: m, completion_field: str = COMPLETION_FIELD) -> PromptCompletion:
    """The :class:`PromptCompletion` of ``row`` (a mapping with ``prompt`` and ``completion``, or the
    response field ``completion_field``); ``messages(list)`` prepares a list of messages for the
    template (joins content parts). Raises ValueError naming the field for anything but two strings
    or two lists of messages."""
    prompt, completion = row[PROMPT_FIELD], row[completion_field]
    for name, v in ((PROMPT_FIELD, prompt), (completion_field, completion)):
        if not isinstance(v, (str, list)):
            raise ValueError(f"'{name}' must be a string or a list of messages, got {brief(v)}")
    if isinstance(prompt, str) != isinstance(completion, str):
        raise ValueError(f"'{PROMPT_FIELD}' and '{completion_field}' must both be strings or both lists of "
                         f"messages; got a {type(prompt).__name__} and a {type(completion).__name__}")
    if isinstance(prompt, str):
        return PromptCompletion(prompt, completion)
    for name, v in ((PROMPT_FIELD, prompt), (completion_field, completion)):
        msg = check_messages(v, name, name_messages=True)
        if msg:
            raise ValueError(msg)
    return PromptCompletion(_prepared(messages, prompt, PROMPT_FIELD),
                            _prepared(messages, completion, completion_field))


def preference_row(row: dict, messages=lambda m: m) -> tuple[PromptCompletion, PromptCompletion]:
    """The (chosen, rejected) :class:`PromptCompletion` s of a preference row (``prompt``, ``chosen``,
    ``rejected``), as TRL's DPO reads them: prompt + chosen and prompt + rejected, the response the
    target. ValueError naming the field as :func:`prompt_completion` does."""
    return tuple(prompt_completion(row, messages, name) for name in (CHOSEN_FIELD, REJECTED_FIELD))


# ---------------------------------------------------------------------------- per-sample values


def group_key(v, name: str) -> str:
    """A row's ``group_column`` value (a string or an integer) as the key rows are grouped by
    (its JSON text: "1" and 1 are two groups). ValueError naming the column for anything else."""
    if isinstance(v, bool) or not isinstance(v, (str, int, np.integer)):
        raise ValueError(f"'{name}' is {brief(v)}; a group id is a string or an integer, and every row needs one "
                         "when group_column names it")
    return json.dumps(v if isinstance(v, str) else int(v))


def sample_value(v, name: str) -> tuple[float, bool]:
    """``(number, is_integer)`` of a row's value ``v`` of column ``name`` (``sample_values:``).
    ValueError naming the column for a missing, boolean, non-numeric or non-finite (NaN, ±inf) value."""
    if v is None:
        raise ValueError(f"no '{name}' value; every row needs one when sample_values names it")
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"'{name}' is {brief(v)}; a per-sample value of an offline build is one number "
                         "(write vectors as several columns)")
    if isinstance(v, (float, np.floating)) and not np.isfinite(v):
        raise ValueError(f"'{name}' is {float(v)}; a per-sample value must be finite (a NaN or infinite reward "
                         "reaches the loss as NaN): drop the row or fill the value")
    return float(v), isinstance(v, (int, np.integer))


def _prepared(messages, v: list, name: str) -> list:
    """``messages(v)``, its errors naming the field ("'prompt' message 0: ...")."""
    try:
        return messages(v)
    except ValueError as exc:
        raise ValueError(f"'{name}' {exc}") from None


def check_messages(v, name: str, *, name_messages: bool = False) -> str | None:
    """Why ``v`` (field ``name``) is not a non-empty list of messages with a ``role`` string; None if
    it is. ``name_messages``: say "'prompt' message 1" rather than "message 1" (rows with two lists)."""
    if not isinstance(v, list) or not v:
        return f"'{name}' must be a non-empty list of messages, got {brief(v)}"
    which = f"'{name}' message" if name_messages else "message"
    for j, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"{which} {j} must be an object with a 'role' string, got {brief(m)}"
    return None


def encode_prompt_completion(tok, rows: list[PromptCompletion], bpe=None, *, tools: list | None = None,
                             loss: str = "assistant", append_eos: bool = True) -> list:
    """``[(input_ids int32 [T], targets bool [T]), ...]``: the ids and completion mask TRL's
    ``SFTTrainer`` gives each row (``completion_only_loss``); ``loss="all"`` trains every token.

    Strings: ids = ``tok(prompt + completion + eos)`` (EOS appended as text unless the completion
    already ends with it, and only with ``append_eos``), one encoding of the concatenated text.
    Messages: ids = ``apply_chat_template(prompt + completion, tools=...)`` (``tools``: each row's
    tool schemas or None; string rows ignore theirs, as TRL does). Either way the first
    ``len(prompt ids)`` tokens are not targets, where prompt ids are ``tok(prompt)``, or
    ``apply_chat_template(prompt, tools=..., add_generation_prompt=True)``; as in TRL, a prompt whose tokens
    are not a prefix of the whole (a token merging across the boundary) still masks that many."""
    out: list = [None] * len(rows)
    tools = tools if tools is not None else [None] * len(rows)
    for conversational in (False, True):
        idx = [i for i, r in enumerate(rows) if r.conversational == conversational]
        if not idx:
            continue
        part = [rows[i] for i in idx]
        if conversational:
            pairs = _encode_conversations(tok, part, bpe, [tools[i] for i in idx])
        else:
            pairs = _encode_strings(tok, part, bpe, append_eos)
        for i, (prompt_ids, ids) in zip(idx, pairs):
            ids = np.asarray(ids, dtype=np.int32)
            mask = np.ones(ids.size, dtype=bool)
            if loss != "all":
                mask[: len(prompt_ids)] = False
            out[i] = (ids, mask)
    return out


def _encode_strings(tok, rows, bpe, append_eos):
    """``[(prompt ids, prompt + completion ids)]`` of string rows, as TRL tokenizes them."""
    eos = tok.eos_token if append_eos else None
    completions = [r.completion if eos is None or r.completion.endswith(eos) else r.completion + eos for r in rows]
    prompt_ids = encode_texts(tok, [r.prompt for r in rows], bpe)
    ids = encode_texts(tok, [r.prompt + c for r, c in zip(rows, completions)], bpe)
    return zip(prompt_ids, ids)


def _encode_conversations(tok, rows, bpe, tools):
    """``[(prompt ids, prompt + completion ids)]`` of message rows: the template's render (with each
    row's ``tools``), encoded without adding special tokens (what ``apply_chat_template(tokenize=True)`` does)."""
    if not getattr(tok, "chat_template", None):
        raise ValueError("prompt and completion are messages, but the tokenizer has no chat template; "
                         "give one with chat_template: FILE, or write them as strings")
    prompts = render_chats(tok, normalize_chats([r.prompt for r in rows]), True, tools)
    wholes = render_chats(tok, normalize_chats([r.prompt + r.completion for r in rows]), False, tools)
    return zip(encode_texts(tok, prompts, bpe, add_special_tokens=False),
               encode_texts(tok, wholes, bpe, add_special_tokens=False))


def brief(v) -> str:
    """``repr(v)``, cut to 80 characters (for error messages)."""
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
