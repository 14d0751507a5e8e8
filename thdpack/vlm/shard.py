"""Where a CP rank's vision tokens sit.

Contract: the vision encoder runs on the whole pack's ``pixel_values`` /
``pixel_values_videos`` (every rank, or one rank and a broadcast), and its
embeddings are scattered into the *global* stream (row ``j`` of the
concatenated image embeddings goes to the ``j``-th image token of the stream)
**before** the CP split. A rank then needs only the rows of its own tokens:

    local_embeds[shard.token_extras["mm_token_type_ids"] == 1] = image_embeds[shard.extras["image_embed_index"]]

or, equivalently, gather the global stream at ``vision_token_positions``.
"""

from thdpack.parallel.cp import VISION_SHARD_KEYS, vision_shard_extras  # noqa: F401 (defined with the CP split)
