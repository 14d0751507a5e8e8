"""Chat content parts to text: the one job of this module is :func:`flatten_content`.

A message's ``content`` may be a list of parts (the OpenAI / ``transformers`` layout
``[{"type": "text", "text": "hi"}, {"type": "image"}, ...]``); chat templates of text
models render strings, so each list becomes one string before the template runs. Image
and video parts become the text the caller says they stand for (the VLM build's
placeholder markers, :mod:`thdpack.offline.vision.vlm_rows`) and are an error in a text build.
"""

from __future__ import annotations

from thdpack.offline.tokenizing.row_conversions import brief as _brief

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
