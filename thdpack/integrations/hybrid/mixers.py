"""Hybrid model families: which sequence-mixing layers a transformers model has besides attention, and what
each reads to keep packed samples apart. One small entry per family; adding a family is adding an entry.

What the layer kinds read (transformers >= 5.25, docs/hybrid.md):

- ``"gdn"`` Gated DeltaNet (Qwen3.5, Qwen3-Next, OlmoHybrid): a short causal convolution (``seq_idx``, or
  ``cu_seqlens``) and the delta-rule scan (``cu_seq_lens_q``, passed to fla as ``cu_seqlens``);
  kernels: ``fla`` (flash-linear-attention) and ``causal_conv1d``.
- ``"mamba2"`` Mamba-2 mixers (Bamba, GraniteMoeHybrid, Nemotron-H, Falcon-H1, Zamba2): convolution and SSD
  scan, both by ``seq_idx``; kernels: ``mamba_ssm`` and ``causal_conv1d``.
- ``"mamba1"`` Mamba-1 mixers (Jamba): transformers' decoder layer passes the mixer no boundary at all, so
  no kernel can keep samples apart: always the per-sample reference path.
- ``"shortconv"`` short convolutions (LFM2): ``seq_idx``; kernel: ``causal_conv1d``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HybridFamily:
    """One family of hybrid models.

    Attributes:
        model_types: the ``config.model_type`` values (top-level and text configs) of the family.
        mixers: class names of its sequence-mixing modules that need sample boundaries.
        kind: ``"gdn"``, ``"mamba2"``, ``"mamba1"`` or ``"shortconv"`` (the module docstring).
    """

    model_types: tuple[str, ...]
    mixers: tuple[str, ...]
    kind: str

    @property
    def kernels(self) -> tuple[str, ...] | None:
        """Import names of the packages with which transformers keeps packed samples apart in these layers
        itself (on CUDA); None where no package can (the mixer gets no boundary)."""
        return KERNELS[self.kind]

    @property
    def continues_state(self) -> bool:
        """Whether the layers' own code continues a sequence from a cache's conv window and recurrent state
        (chunked prefill). transformers' Mamba-1 scan (Jamba) ignores a cache's state over several tokens,
        so a trie replays each segment's whole path there (:mod:`thdpack.integrations.hybrid.state_forks`)."""
        return self.kind != "mamba1"

    @property
    def reads(self) -> str:
        """What the layers read, in words (docs, error messages)."""
        return READS[self.kind]


KERNELS = {"gdn": ("fla", "causal_conv1d"), "mamba2": ("mamba_ssm", "causal_conv1d"), "mamba1": None,
           "shortconv": ("causal_conv1d",)}
READS = {
    "gdn": "a short convolution (seq_idx) and a Gated DeltaNet scan (cu_seq_lens_q)",
    "mamba2": "a short convolution and a Mamba-2 scan (seq_idx)",
    "mamba1": "a Mamba-1 convolution and scan (transformers passes them no boundary)",
    "shortconv": "a short causal convolution (seq_idx)",
}

FAMILIES: tuple[HybridFamily, ...] = (
    HybridFamily(("qwen3_5", "qwen3_5_text"), ("Qwen3_5GatedDeltaNet",), "gdn"),
    HybridFamily(("qwen3_5_moe", "qwen3_5_moe_text"), ("Qwen3_5MoeGatedDeltaNet",), "gdn"),
    HybridFamily(("qwen3_next",), ("Qwen3NextGatedDeltaNet",), "gdn"),
    HybridFamily(("olmo_hybrid",), ("OlmoHybridGatedDeltaNet",), "gdn"),
    HybridFamily(("bamba",), ("BambaMixer",), "mamba2"),
    HybridFamily(("granitemoehybrid",), ("GraniteMoeHybridMambaLayer",), "mamba2"),
    HybridFamily(("nemotron_h",), ("NemotronHMamba2Mixer",), "mamba2"),
    HybridFamily(("falcon_h1",), ("FalconH1Mixer",), "mamba2"),
    HybridFamily(("zamba2",), ("Zamba2MambaMixer",), "mamba2"),
    HybridFamily(("jamba",), ("JambaMambaMixer",), "mamba1"),
    HybridFamily(("lfm2", "lfm2_vl"), ("Lfm2ShortConv",), "shortconv"),
    HybridFamily(("lfm2_moe",), ("Lfm2MoeShortConv",), "shortconv"),
)

MIXER_FAMILIES = {name: family for family in FAMILIES for name in family.mixers}

# layer-type names of transformers configs that are attention (or need no boundary: MLP-only blocks)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "attention", "sliding_attention", "chunked_attention", "mlp",
                                   "moe", "dense"})
WINDOWED_LAYER_TYPES = frozenset({"sliding_attention", "chunked_attention"})


def config_layer_types(config) -> list[str]:
    """Every layer-type name a transformers config (or its ``text_config``) lists: ``layer_types``,
    ``layers_block_type``, ``hybrid_override_pattern``-style lists; empty if it lists none."""
    found: list[str] = []
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        for name in ("layer_types", "layers_block_type"):
            values = getattr(cfg, name, None)
            if isinstance(values, (list, tuple)):
                found += [str(v) for v in values]
    return found
