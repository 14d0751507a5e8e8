"""Where each assistant turn lies in a conversation rendered once by a chat template
without ``{% generation %}`` markers.

The trained text is the conversation as the template renders it once (``T``). An
assistant turn's targets are its rendered body: everything the template writes for it
after its role header (the template's generation prompt, e.g. ``<|im_start|>assistant\\n``)
through its end-of-turn token (e.g. ``<|im_end|>``): the content, a reasoning block
where the template renders one, the tool calls. Nothing is rendered twice, so templates
that render a turn differently depending on what follows it (Qwen3 drops the reasoning
of turns before the last user message) are handled as they render.

How the turns are found: the conversation is rendered a second time (``V``) with every
assistant message replaced by one whose content is :data:`SENTINEL` (no reasoning, no
tool calls). Outside the assistant turns' bodies the two renders are the same text, so
``V`` cut at each turn (after its header, around its sentinel) gives the pieces ``T``
must be made of, in order: ``T = G0 + B1 + G1 + ... + Bn + Gn`` where ``G0`` ends with
the first turn's header, each ``Gj`` runs from the end of turn ``j``'s body through the
next turn's header, and the bodies ``Bj`` are what the turns really render. A turn's
targets are its body and the end-of-turn text that starts ``Gj``.

The header and the end-of-turn text are the template's own (:func:`turn_marks`, from
renders of a probe conversation). A template where this does not hold (no header before
a turn, a turn that is not rendered, text outside the turns that depends on them) is an
error naming the message; the way out is a template with ``{% generation %}`` markers
(``chat_template:``).
"""

from __future__ import annotations

from dataclasses import dataclass

# private-use characters: no template changes them (strip, trim, split on markup)
SENTINEL = "\ue000thdpack-turn\ue001"
_PROBE_USER = {"role": "user", "content": "\ue000thdpack-user\ue001"}
WHAT_TO_DO = ("give a template with {% generation %} markers around the assistant turns with `chat_template:` "
              "(docs/build.md, Chat rows), or set loss: all")


class TemplateNotSupported(ValueError):
    """The chat template does not render assistant turns in a way :func:`assistant_spans` can locate."""


@dataclass(frozen=True)
class TurnMarks:
    """What a template writes around an assistant turn's body."""

    header: str  # the generation prompt: what comes before a turn's body ('' when the template has none)
    end: str  # the text after the body through the first special token ('<|im_end|>'); '' when none follows


def turn_marks(render, special_tokens) -> TurnMarks:
    """The header and end-of-turn text of a template. ``render(conversations,
    add_generation_prompt)`` renders normalized conversations (as
    :func:`thdpack.offline.tokenizing.chat_render.render_chats`); ``special_tokens``: the tokenizer's
    special token strings. Raises :class:`TemplateNotSupported`, or the template's own error."""
    probe = [_PROBE_USER, {"role": "assistant", "content": SENTINEL}]
    plain, prompted, answered = render([probe[:1]], False)[0], render([probe[:1]], True)[0], render([probe], False)[0]
    if not prompted.startswith(plain):
        raise TemplateNotSupported("the chat template's generation prompt does not extend the conversation it "
                                   f"follows, so assistant turns cannot be told from their header; {WHAT_TO_DO}")
    if answered.count(SENTINEL) != 1:
        raise TemplateNotSupported(f"the chat template does not render an assistant message's content once; {WHAT_TO_DO}")
    header = prompted[len(plain):]
    at = answered.index(SENTINEL)
    if answered.rfind(header, 0, at) < 0:
        raise TemplateNotSupported(f"the chat template's generation prompt {header!r} is not what it renders before "
                                   f"an assistant message, so assistant turns cannot be told from it; {WHAT_TO_DO}")
    tail = answered[at + len(SENTINEL):]
    ends = [tail.index(s) + len(s) for s in special_tokens if s and s in tail]
    return TurnMarks(header=header, end=tail[: min(ends)] if ends else "")


def with_sentinels(conversation: list) -> list:
    """``conversation`` with every assistant message replaced by one of content :data:`SENTINEL`."""
    return [{"role": "assistant", "content": SENTINEL} if m.get("role") == "assistant" else m for m in conversation]


def assistant_spans(text: str, variant: str, turns: list[int], marks: TurnMarks) -> list[tuple[int, int]]:
    """``[(start, end)]`` character spans of ``text`` (a conversation rendered once), one per
    assistant message (``turns``: their indices), in order; ``variant``: the conversation
    rendered through :func:`with_sentinels`. Raises :class:`TemplateNotSupported` naming the
    message when a turn cannot be located."""
    if not turns:
        return []
    pieces = _pieces(variant, turns, marks.header)
    if not text.startswith(pieces[0]):
        raise _not_found(turns[0], "the text before it depends on the assistant turns")
    spans: list[tuple[int, int]] = []
    start = len(pieces[0])
    for j, (k, after) in enumerate(zip(turns, pieces[1:])):
        if j < len(turns) - 1:
            end = text.find(after, start)
        else:  # the last piece ends the text
            end = len(text) - len(after) if text.endswith(after) else -1
        if end < start:
            raise _not_found(k, "the text after it depends on the assistant turns")
        if not after.startswith(marks.end):
            raise _not_found(k, f"it does not end with {marks.end!r} as the last turn does")
        spans.append((start, end + len(marks.end)))
        start = end + len(after)
    return spans


def _pieces(variant: str, turns: list[int], header: str) -> list[str]:
    """``[G0, G1, ..., Gn]``: ``variant`` cut after each turn's header and after its sentinel."""
    found = variant.count(SENTINEL)
    if found != len(turns):
        raise TemplateNotSupported(f"the chat template renders {found} of the conversation's {len(turns)} assistant "
                                   f"messages (indices {turns}), so their turns cannot be located; {WHAT_TO_DO}")
    pieces, y = [], 0
    for k in turns:
        s = variant.index(SENTINEL, y)
        h = variant.rfind(header, y, s)
        if h < 0:
            raise _not_found(k, f"no {header!r} header (the template's generation prompt) before its content")
        pieces.append(variant[y:h + len(header)])
        y = s + len(SENTINEL)
    pieces.append(variant[y:])
    return pieces


def template_failed(what: str, error: str) -> TemplateNotSupported:
    """The error for a template that raises ``error`` (one line) on ``what`` it renders for locating turns."""
    return TemplateNotSupported(f"the chat template fails on {what} ({error}), so assistant turns cannot be "
                                f"located; {WHAT_TO_DO}")


def _not_found(k: int, why: str) -> TemplateNotSupported:
    return TemplateNotSupported(f"cannot locate assistant message {k} in the rendered conversation ({why}); {WHAT_TO_DO}")
