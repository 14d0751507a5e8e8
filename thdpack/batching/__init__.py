"""One pack's THD stream: the layout options, the one-pass builder, its kernel and ThdBatch."""
