"""Input rows of an offline build: files and sources, JSON Lines, memory-mapped rows, input slices."""
