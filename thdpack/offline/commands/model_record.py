"""The model config of a build (``model_config:`` / ``--model-config``): loading it,
recording it in the output and what the FLOPs report needs from it.

A model config is a ``config.json`` file, a directory holding one, or (in YAML) the
mapping itself; it is read as plain JSON (``transformers`` is not needed). The build
uses it twice:

- the whole-model FLOPs over-count of counting every pack as one ``pack_size``-token
  sequence (:func:`thdpack.flops.model_overcount_factor`), next to the attention one;
- for rows with images, the VLM family (placeholder token ids, merge size, image
  processor defaults): see :mod:`thdpack.offline.vision.vlm_setup`.

A copy is saved in the output (``model_config.json``) so that ``thdpack stats`` and the
VLM collator of :func:`load_packed` find it again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from thdpack.common.model_config import config_get
from thdpack.offline.stages import read_checked_model_config

MODEL_CONFIG_FILE = "model_config.json"


def model_info(config: dict, given) -> dict:
    """What metadata.json records about the model config: as given, its ``model_type``
    and a content fingerprint."""
    return {
        "given": given if isinstance(given, str) else "inline mapping",
        "model_type": config.get("model_type"),
        "fingerprint": hashlib.sha256(canonical_json(config).encode()).hexdigest(),
        "saved_copy": MODEL_CONFIG_FILE,
    }


def canonical_json(config: dict) -> str:
    """``config`` as indented JSON text with sorted keys: the saved copy, and what the fingerprint hashes."""
    return json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def model_flops_summary(config, num_packs: int, pack_size: int, real_tokens: int, seqlen_squared_sum: int,
                        num_samples: int, vision_grid_thw=None, seq_lens=None) -> dict:
    """The whole-model over-count factors for :func:`thdpack.offline.commands.pack_stats.summarize`.

    ``overcount``: ``model_flops`` of ``num_packs`` sequences of ``pack_size`` tokens over
    ``model_flops`` of the real tokens and ``Σ sᵢ²`` (:func:`thdpack.flops.model_overcount_factor`);
    ``overcount_samples_at_pack_len``: the same when every *sample* is charged a whole
    ``pack_size`` sequence. A VLM's vision tower (``vision_grid_thw`` given) counts the
    same in both, as a pack-length count charges it. ``seq_lens`` (int ``[n]``, the packed samples' lengths)
    gives the counts a windowed or top-k model needs beyond ``Σ sᵢ²``. A config the FLOPs module does not
    cover gives ``{"error": ...}`` instead of stopping the build.
    """
    from thdpack.flops import model_flops, model_overcount_factor, needed_length_counts

    options = {}
    if vision_grid_thw is not None and len(vision_grid_thw) and config_get(config, "vision_config", None) is not None:
        options["vision_grid_thw"] = vision_grid_thw
    out = {"model_type": config_get(config, "model_type", None)}
    try:
        if not seqlen_squared_sum:
            raise ValueError("no tokens")
        if seq_lens is not None and needed_length_counts(config):  # windows, top-k: counts beyond Σ sᵢ²
            options["seq_lens"] = seq_lens
        out["overcount"] = model_overcount_factor(config, num_packs, pack_size, real_tokens, seqlen_squared_sum, **options)
        out["overcount_samples_at_pack_len"] = model_overcount_factor(
            config, num_samples, pack_size, real_tokens, seqlen_squared_sum, **options)
        out["real_flops"] = int(model_flops(config, real_tokens, seqlen_squared_sum, **options))
        out["vision_included"] = "vision_grid_thw" in options
    except (KeyError, TypeError, ValueError, NotImplementedError, AttributeError) as exc:
        out = {"model_type": out["model_type"], "error": f"{type(exc).__name__}: {exc}"}
    return out


def packed_model_config(ds, given: str | None = None) -> dict:
    """``summarize`` keyword arguments for the FLOPs report of packed dataset ``ds``:
    the model config ``given`` (a path), else the copy saved with the dataset, and the
    image grids of a VLM dataset. ``{}`` when there is no model config."""
    path = given if given else (ds.path / MODEL_CONFIG_FILE if (ds.path / MODEL_CONFIG_FILE).is_file() else None)
    if path is None:
        return {}
    out = {"model_config": read_checked_model_config(Path(path))}
    if "image_grid_thw" in getattr(ds, "columns", []):
        from thdpack.offline.store.vision_readback import all_image_grids

        out["vision_grid_thw"] = all_image_grids(ds)
    return out
