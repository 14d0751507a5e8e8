"""Omni models (Qwen2.5-Omni, Qwen3-Omni thinkers) packed: audio clips beside images and videos, their
time-aligned rotary positions (TMRoPE) per sample on the THD stream."""
