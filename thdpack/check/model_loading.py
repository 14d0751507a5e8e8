"""The model ``thdpack check`` runs: a local Hugging Face model directory, with its weights as saved, or a
``config.json`` (a file, or a directory without weights) with random weights; nothing is downloaded.

The one module of thdpack/check that imports transformers at its top: the class comes from the config
(a Qwen-VL config with a ``vision_config``: ``AutoModelForImageTextToText``; else ``AutoModelForCausalLM``),
the attention implementation is any name transformers knows, or thdpack's varlen backend
(:data:`thdpack.attention.backends.VARLEN_ATTENTION`, registered here on first use).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

from thdpack.attention.backends import VARLEN_ATTENTION

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("cpu", "cuda")
# what a directory holds when its weights were saved (save_pretrained, the hub's layout)
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model*.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class LoadedModel:
    """The model, and in words where it came from (``source``: its path and weights or random weights)."""

    model: torch.nn.Module
    source: str


def load_model(path, *, random_weights: bool | None = None, dtype: str = "float32", device: str = "cpu",
               attn: str | None = None, seed: int = 0) -> LoadedModel:
    """The model at ``path``, in eval mode, ``dtype`` on ``device``.

    Args:
        path: a model directory (``config.json`` and, when saved, its weights) or a ``config.json`` file.
        random_weights: True: random weights from the config whatever the directory holds; None: random
            only where the directory has no weights; False: the saved weights (an error without them).
        dtype: ``float32``, ``bfloat16`` or ``float16``; device: ``cpu`` or ``cuda``.
        attn: an ``attn_implementation`` transformers knows, ``thdpack_varlen``, or None (the config's or
            transformers' default).
        seed: seeds the random initialisation.

    Raises ``ValueError`` in one line: a missing path, no config, saved weights asked for and absent, an
    unknown dtype / device / attention, CUDA asked for and absent, a config of no causal LM.
    """
    path = Path(path)
    torch_dtype, device = _dtype(dtype), _device(device)
    config_file = _config_file(path)
    config = transformers.AutoConfig.from_pretrained(str(config_file), local_files_only=True)
    weights = path.is_dir() and _has_weights(path)
    if random_weights is False and not weights:
        raise ValueError(f"{path}: no saved weights (model*.safetensors, pytorch_model*.bin); leave "
                         "random_weights=None to check the config with random weights")
    random = bool(random_weights) or not weights
    cls = model_class(config)
    kwargs = {"dtype": torch_dtype}
    if attn is not None:
        kwargs["attn_implementation"] = _attention(attn)
    try:
        if random:
            torch.manual_seed(seed)
            model = cls.from_config(config, **kwargs)
        else:
            model = cls.from_pretrained(str(path), local_files_only=True, **kwargs)
    except ImportError as exc:  # an attention backend whose package is absent (flash-attn, kernels)
        raise ValueError(f"--attn {attn}: {' '.join(str(exc).split())}") from None
    model = model.to(device=device, dtype=torch_dtype).eval()
    what = f"random weights (seed {seed})" if random else "its saved weights"
    return LoadedModel(model, f"{type(model).__name__} from {path}: {what}, {dtype} on {device}, attention "
                              f"{model.config._attn_implementation}")


def model_class(config):
    """The Auto class for ``config``: a VLM config (one with a ``vision_config``) the image-text-to-text one,
    any other the causal LM one; ``ValueError`` for a config of neither."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "vision_config", None) is not None and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    raise ValueError(f"model_type {model_type!r}: transformers {transformers.__version__} has no causal LM (nor "
                     "image-text-to-text model) of this type; thdpack check runs causal LMs and Qwen-VL models")


def _config_file(path: Path) -> Path:
    if not path.exists():
        raise ValueError(f"--model {path}: no such file or directory (a local model directory or a config.json; "
                         "nothing is downloaded)")
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise ValueError(f"--model {path}: the directory has no config.json (a Hugging Face model directory, as "
                         "save_pretrained writes it)")
    return config


def _has_weights(path: Path) -> bool:
    return any(next(path.glob(pattern), None) is not None for pattern in WEIGHT_FILES)


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype {name}: one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _device(name: str) -> str:
    if name not in DEVICES:
        raise ValueError(f"--device {name}: one of {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device here (torch {torch.__version__}, "
                         f"torch.cuda.is_available() is False); check on the CPU with --device cpu")
    return name


def _attention(name: str) -> str:
    """``name``, with thdpack's varlen backend registered in transformers when it is that one."""
    if name == VARLEN_ATTENTION:
        from thdpack.integrations.varlen_attention import register_varlen_attention

        return register_varlen_attention()
    return name
