"""The on-disk format: metadata and its schema, writing pack rows and vision columns, staging and atomic commit, reading packs back."""
