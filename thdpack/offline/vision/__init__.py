"""Rows with images and videos: the VLM set-up, the VLM row tokenizer, media and video decoding."""
