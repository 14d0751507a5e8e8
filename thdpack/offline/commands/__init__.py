"""The offline commands: `thdpack build` (`build_packs.py`), `stats` (`pack_stats.py`), `merge`
(`slice_merge.py`), `export` (`bridge_export.py`), and what a build records of its model (`model_record.py`)
and shares of its groups' prompts (`shared_prefixes.py`). The CLI parses flags (`thdpack/cli/`); these do the work."""
