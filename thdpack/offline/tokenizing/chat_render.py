"""Chat templates rendered to text, many conversations per call, checked against
``apply_chat_template(..., tokenize=False)`` (:func:`render_chats`), and the one template call
the token-level fast paths also make (:func:`render_template`)."""

from __future__ import annotations

from thdpack.offline.tokenizing.fast_checks import CHECK_ROWS, decided, per_tools

# ---------------------------------------------------------------------------- rendering many conversations
#
# ``apply_chat_template(conv, tokenize=False)`` per conversation spends about as long
# normalizing the messages and setting up as rendering. ``render_chats`` renders a whole
# list in one ``render_jinja_template`` call (what ``apply_chat_template`` calls), on
# messages normalized once (``normalize_chats``; a prefix of a normalized conversation is
# the normalized prefix). The first call in a process compares it with
# ``apply_chat_template`` on the first conversations, with and without the generation
# prompt; any difference, or another transformers version, and every call goes through
# ``apply_chat_template``.

_render_checked: dict[int, tuple[object, bool]] = {}  # id(tokenizer) -> (tokenizer, batched rendering usable)


def normalize_chats(conversations: list) -> list:
    """The conversations as ``apply_chat_template`` normalizes them (message objects to dicts,
    ``None`` values dropped); as given when this transformers version has no such step.
    Content parts are already joined into strings by then (the row checks,
    :func:`thdpack.offline.tokenizing.chat_content.flatten_content`)."""
    try:
        from transformers.tokenization_utils_base import _normalize_chat_messages
    except ImportError:
        return list(conversations)
    return [_normalize_chat_messages(c) for c in conversations]


def render_chats(tok, conversations: list, add_generation_prompt: bool, tools: list | None = None) -> list[str]:
    """``[tok.apply_chat_template(c, tools=t, tokenize=False, add_generation_prompt=...) for c, t in
    zip(conversations, tools)]`` for conversations already through :func:`normalize_chats`
    (``tools``: each conversation's tool schemas or None; omitted: no tools)."""
    return per_tools(conversations, tools, lambda convs, kw: _render_group(tok, convs, add_generation_prompt, kw))


def _render_group(tok, conversations, add_generation_prompt, kw) -> list[str]:
    """:func:`render_chats` of conversations that share their tools (``kw``: ``{"tools": ...}`` or ``{}``)."""
    head = conversations[:CHECK_ROWS]
    ok = decided(_render_checked, id(tok), tok, lambda: all(
        _render_fast(tok, head, flag, **kw) == _render_slow(tok, head, flag, **kw) for flag in (False, True)))
    if ok and conversations:
        out = _render_fast(tok, conversations, add_generation_prompt, **kw)
        if out is not None:
            return out
    return _render_slow(tok, conversations, add_generation_prompt, **kw)


def render_template(tok, conversations, add_generation_prompt: bool, *, assistant_spans: bool = False, tools=None):
    """``(texts, {% generation %} character spans)``: the call ``apply_chat_template`` makes,
    for normalized conversations."""
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template(
        conversations=conversations, tools=tools, documents=None, chat_template=tok.get_chat_template(None, tools),
        return_assistant_tokens_mask=assistant_spans, continue_final_message=False,
        add_generation_prompt=add_generation_prompt, **tok.special_tokens_map,
    )


def _render_fast(tok, conversations, add_generation_prompt, tools=None):
    try:
        return list(render_template(tok, conversations, add_generation_prompt, tools=tools)[0])
    except Exception:  # noqa: BLE001 - another transformers version, or a conversation it rejects
        return None


def _render_slow(tok, conversations, add_generation_prompt, tools=None):
    return [tok.apply_chat_template(c, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
            for c in conversations]


# ---------------------------------------------------------------------------- roles the template drops

_ROLE_PROBE = "thdpack role probe 7f3a"


def role_renders(tok, role: str) -> bool:
    """Whether ``tok``'s chat template renders a message of ``role`` at all (a template that knows a
    fixed set of roles, like Qwen3's, prints nothing for another, e.g. ``wizard``: the message would
    vanish from the packs). A role the template's text names is taken as rendered; another is probed
    once with a conversation holding a message of it between a user and an assistant message. A probe
    the template refuses decides nothing (True): the row's own render then fails or not by itself."""
    template = getattr(tok, "chat_template", None)
    if f"'{role}'" in str(template) or f'"{role}"' in str(template):
        return True
    probe = [{"role": "user", "content": "hello"}, {"role": role, "content": _ROLE_PROBE},
             {"role": "assistant", "content": "hello"}]
    try:
        return _ROLE_PROBE in tok.apply_chat_template(probe, tokenize=False)
    except Exception:  # noqa: BLE001 - the template's own refusal of the role
        return True
