"""What a check watches inside a model: the embeddings the language model is given where it is given them
(a VLM's text and merged vision embeddings), each decoder layer, each sequence mixer in it (attention, linear
attention, SSM) and the token-mixing steps inside a mixer that transformers runs as functions (the short
convolution, the linear-attention / SSM scan), with the boundary inputs each reads. A vision tower's own
modules are not watched: its output reaches the language model in the embeddings.

:class:`Probes` hooks them for one forward: every output is kept as float32 ``[tokens, features]`` along
the stream (several calls of one module in a forward, as a per-sample path makes, are joined in order), so a
run of the pack and a run of a sample can be compared module by module.
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass

import torch

from thdpack.integrations.hybrid.mixers import MIXER_FAMILIES

# what each kind of module reads to keep packed samples apart (the report names it beside a failure)
READS = {
    "embeddings": "the vision inputs (pixel_values, image_grid_thw / video_grid_thw, their order) and the "
                  "placeholder tokens they fill",
    "decoder layer": "every boundary input of its mixers",
    "attention": "the attention mask (cu_seq_lens_q / cu_seq_lens_k on a varlen backend) and position_ids (RoPE)",
    "linear attention": "seq_idx (its convolution) and cu_seq_lens_q (its scan)",
    "SSM": "seq_idx (its convolution and scan)",
    "convolution": "seq_idx (cu_seq_lens_q where the layer takes it)",
    "scan": "cu_seq_lens_q (Gated DeltaNet) or seq_idx (Mamba-2)",
    "logits": "everything before it",
}
MIXER_KINDS = {"gdn": "linear attention", "mamba2": "SSM", "mamba1": "SSM", "shortconv": "convolution"}
# functions transformers' hybrid layers call on the sequence (not modules, so no module hook sees them):
# name pattern -> (step, the kind it is reported as, the axis its sequence lies on): Mamba-1's scan gives
# [batch, channels, tokens], Gated DeltaNet's and Mamba-2's [batch, tokens, heads, dim]
_STEP_FUNCTIONS = ((re.compile(r"^causal_conv1d_(forward|fn)$"), "conv", "convolution", -1),
                   (re.compile(r"^mamba_scan_forward$|^mamba_selective_scan$|^selective_scan_fn$"), "scan", "scan",
                    -1),
                   (re.compile(r"^(torch_)?chunk_gated_delta_rule$|^mamba2_(chunk_)?scan(_forward)?$|"
                               r"^mamba2_selective_scan$|^mamba2?_split_conv1d_scan_combined$|"
                               r"^mamba_chunk_scan_combined$"), "scan", "scan", 1))


@dataclass
class Watched:
    """One watched module (or step of one): its name, kind (a key of :data:`READS`) and execution order."""

    name: str
    kind: str
    order: int = -1

    @property
    def reads(self) -> str:
        return READS[self.kind]


def decoder_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """``(name, layer)`` of the language model's decoder layers: the longest ``ModuleList`` outside a vision
    tower (``ValueError`` when the model has none)."""
    name, layers = _layer_list(model)
    return [(f"{name}.{i}", layer) for i, layer in enumerate(layers)]


def language_model(model) -> tuple[str, torch.nn.Module]:
    """``(name, module)`` of the module that holds the decoder layers (``model.model``,
    ``model.model.language_model``, ...); ``("", model)`` when the model holds them itself."""
    name, _ = _layer_list(model)
    parent = name.rpartition(".")[0]
    return parent, model.get_submodule(parent)


def _layer_list(model) -> tuple[str, torch.nn.ModuleList]:
    best: tuple[str, torch.nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and not re.search(r"visual|vision", name):
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    if best is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (a ModuleList of layers)")
    return best


def module_kind(module: torch.nn.Module) -> str | None:
    """The kind of a sequence mixer (``attention``, ``linear attention``, ``SSM``, ``convolution``), else None."""
    name = type(module).__name__
    if name in MIXER_FAMILIES:
        return MIXER_KINDS[MIXER_FAMILIES[name].kind]
    if name.endswith("Attention") and not re.search(r"Vision|Visual", name):
        return "attention"
    return None


class Probes:
    """Forward hooks on the embeddings a model's language model is given, its decoder layers, its mixers and
    their step functions, for one forward at a time (:meth:`watch`); after it, :attr:`outputs` maps each name
    to a float32 ``[tokens, features]`` tensor and :attr:`watched` lists what was seen, in execution order."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.embeddings = language_model(model)
        self.targets: list[tuple[str, str, torch.nn.Module]] = []
        for layer_name, layer in decoder_layers(model):
            self.targets.append((layer_name, "decoder layer", layer))
            for name, module in layer.named_modules(prefix=layer_name):
                kind = module_kind(module) if module is not layer else None
                if kind is not None:
                    self.targets.append((name, kind, module))
        self.watched: dict[str, Watched] = {}
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self._active_mixer: list[str] = []
        self._in_step = 0

    @contextlib.contextmanager
    def watch(self):
        """Record the outputs of one forward (earlier records are dropped)."""
        self.outputs = {}
        self.watched = {}
        lm_name, lm = self.embeddings
        handles = [lm.register_forward_pre_hook(self._given(f"{lm_name or 'model'}.inputs_embeds"),
                                                with_kwargs=True)]
        for name, kind, module in self.targets:
            handles.append(module.register_forward_pre_hook(self._enter(name, kind)))
            handles.append(module.register_forward_hook(self._leave(name, kind)))
        undo = self._wrap_step_functions()
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            undo()
            self._active_mixer = []

    def _given(self, name: str):
        def hook(module, args, kwargs):
            self._record(name, "embeddings", kwargs.get("inputs_embeds"), 1)  # None where it is given ids
        return hook

    def _enter(self, name: str, kind: str):
        def hook(module, args):
            if kind != "decoder layer":
                self._active_mixer.append(name)
        return hook

    def _leave(self, name: str, kind: str):
        def hook(module, args, output):
            if kind != "decoder layer" and self._active_mixer:
                self._active_mixer.pop()
            self._record(name, kind, _first_tensor(output), 1)
        return hook

    def _record(self, name: str, kind: str, tensor, axis: int) -> None:
        if tensor is None or tensor.dim() < 2:
            return
        if name not in self.watched:
            self.watched[name] = Watched(name, kind, len(self.watched))
        self.outputs.setdefault(name, []).append(_as_rows(tensor.detach(), axis))

    def _wrap_step_functions(self):
        """Wrap the step functions of the mixers' modeling modules so each call is recorded under
        ``MIXER.conv`` / ``MIXER.scan``; returns the function that restores them."""
        restored = []
        modules = {type(m).__module__ for _, kind, m in self.targets if kind in MIXER_KINDS.values()}
        for module_name in modules:
            namespace = sys.modules.get(module_name)
            if namespace is None:
                continue
            for attr, value in list(vars(namespace).items()):
                for pattern, step, kind, axis in _STEP_FUNCTIONS:
                    if callable(value) and pattern.search(attr):
                        setattr(namespace, attr, self._step(value, step, kind, axis))
                        restored.append((namespace, attr, value))
                        break

        def undo():
            for namespace, attr, value in restored:
                setattr(namespace, attr, value)
        return undo

    def _step(self, function, step: str, kind: str, axis: int):
        def wrapped(*args, **kwargs):
            self._in_step += 1
            try:
                out = function(*args, **kwargs)
            finally:
                self._in_step -= 1
            if self._active_mixer and not self._in_step:  # the outermost step only
                tensor = _first_tensor(out)
                if tensor is not None and step == "conv":
                    length = _conv_length(args, kwargs)
                    tensor = tensor[..., :length] if length is not None else tensor
                self._record(f"{self._active_mixer[-1]}.{step}", kind, tensor, axis)
            return out
        wrapped.__wrapped__ = function
        return wrapped

    def stream(self, name: str) -> torch.Tensor:
        """The output of ``name`` over the whole forward: float32 ``[tokens, features]``."""
        parts = self.outputs[name]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _first_tensor(output):
    """The first tensor of a module's output (a tensor, a tuple, a ``ModelOutput``), else None."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
        return None
    for value in getattr(output, "values", lambda: [])():
        if isinstance(value, torch.Tensor):
            return value
    return None


def _as_rows(tensor: torch.Tensor, axis: int) -> torch.Tensor:
    """``tensor`` with batch axis 1 (``[1, ...]``) as float32 ``[tokens, features]``, tokens on ``axis``."""
    t = tensor.float()
    if t.dim() >= 3 and t.shape[0] == 1:
        t = t[0]
        axis = axis - 1 if axis > 0 else axis
    t = t.movedim(axis, 0)
    return t.reshape(t.shape[0], -1)


def _conv_length(args, kwargs) -> int | None:
    """The sequence length of a convolution step's input (its output may carry the kernel's extra steps)."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() == 3:
            return int(value.shape[-1])
    return None
