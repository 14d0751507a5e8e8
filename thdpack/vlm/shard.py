"""Where a CP rank's vision tokens sit.

Contract: the vision encoder runs on the whole pack's ``pixel_values`` /
``pixel_values_videos`` (every rank, or one rank and a broadcast), and its
embeddings are scattered into the *global* stream (row ``j`` of the
concatenated image embeddings goes to the ``j``-th image token of the stream)
**before** the CP split. A rank then needs only the rows of its own tokens:

    local_embeds[shard.token_extras["mm_token_type_ids"] == 1] = image_embeds[shard.extras["image_embed_index"]]

or, equivalently, gather the global stream at ``vision_token_positions``.
"""

from __future__ import annotations

import torch

VISION_SHARD_KEYS = ("vision_token_positions", "image_embed_index", "video_embed_index")


def vision_shard_extras(mm_token_type_ids: torch.Tensor, index: torch.Tensor) -> dict:
    """Per-rank vision positions for a shard that keeps stream positions ``index``.

    Args:
        mm_token_type_ids: int ``[T]`` of the whole batch (0 text, 1 image, 2 video).
        index: int64 ``[T / cp]`` the rank's stream positions (``partition_indices``).

    Returns:
        ``vision_token_positions``: int64, global stream positions of the rank's image
        and video tokens, in local order; ``image_embed_index`` / ``video_embed_index``:
        int64, for each local image / video token (local order), its row in the
        concatenated image / video embeddings.
    """
    types = mm_token_type_ids.to(index.device)
    local = types[index]
    out = {"vision_token_positions": index[local != 0]}
    for kind, key in ((1, "image_embed_index"), (2, "video_embed_index")):
        ordinal = torch.cumsum((types == kind).to(torch.int64), 0) - 1  # row of each token of this kind
        out[key] = ordinal[index][local == kind]
    return out
