"""Rows to token ids and targets: the row tokenizer and formats, tokenizer loading, chat content and spans, the fast BPE paths."""
