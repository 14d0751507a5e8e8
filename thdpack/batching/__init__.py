"""One pack's THD stream: the layout options, the one-pass builder, its kernel and ThdBatch, and the batch's
attention views (``views.py``). ``build_thd_batch``, ``ThdBatch`` and ``shard`` are ``thdpack``'s."""

from thdpack.batching.layout import BatchLayout
from thdpack.batching.views import (attention_mask_4d, block_mask, document_ids, document_parents, padding_mask, seq_idx,
                                    static_cu_seqlens, static_cu_seqlens_padded, static_max_seqlen)

__all__ = ["BatchLayout", "block_mask", "attention_mask_4d", "document_ids", "document_parents", "padding_mask",
           "seq_idx", "static_cu_seqlens", "static_cu_seqlens_padded", "static_max_seqlen"]
