"""One pack's THD stream: the layout options, the one-pass builder, its kernel and ThdBatch.
``build_thd_batch``, ``ThdBatch`` and the shard functions are ``thdpack``'s."""

from thdpack.batching.layout import BatchLayout

__all__ = ["BatchLayout"]
