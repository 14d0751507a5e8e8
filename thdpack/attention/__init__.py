"""Attention layouts of a THD batch, from its offsets: document ids, masks, seq_idx, static shapes."""
