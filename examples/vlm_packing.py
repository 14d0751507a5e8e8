"""VLM in-batch packing: image-processor outputs -> THD packs -> one training step.

    python examples/vlm_packing.py [--family qwen2_5_vl] [--num-samples 12] [--pack-size 1024]

Everything runs offline on the CPU in a few seconds:

1. images are generated with numpy (gradients, checkerboards, stripes, rings,
   noise; several sizes) and run through the family's image processor, built
   locally with small ``min_pixels`` / ``max_pixels`` (nothing is downloaded);
2. chat-like samples are tokenized with the bundled demo tokenizer: a user turn
   holding 0-2 images (``<|vision_start|>``, one ``<|image_pad|>`` per merged
   patch, ``<|vision_end|>``) and a question, then an assistant answer. Labels
   mask the whole prompt (system and user turns, image placeholders, the
   ``<|im_start|>assistant`` header) and score the answer;
3. ``ThdCollator(vlm=get_family(cfg), pack_size=..., vision_budget=...)`` plans the
   samples into packs under a token budget and a ViT-patch budget and builds
   each pack as one THD stream with ``mm_token_type_ids``, the 3 mRoPE rows and
   the pack's concatenated ``pixel_values`` / ``image_grid_thw``;
4. a tiny random-weight model of the family (Qwen2.5-VL by default; fp32, CPU,
   sdpa), prepared once with ``packed_model(model)``, checks that the first pack
   gives, sample by sample, the logits each sample gives alone, then takes one
   packed training step (forward + backward + AdamW step) on it.

``--family qwen3_5`` is a hybrid: a Gated DeltaNet layer, then a full-attention
one. ``packed_model`` runs its Gated DeltaNet layer on each sample's span alone
where the kernels that keep packed samples apart are missing (always on the CPU;
docs/hybrid.md).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from thdpack import ThdCollator
from thdpack.demo.models import TINY_TEXT
from thdpack.flops import seqlen_squared_sum
from thdpack.integrations import packed_model
from thdpack.vlm import get_family, vision_lengths
from thdpack.integrations import to_hf_kwargs

IGNORE = -100
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
# Qwen2-VL / Qwen2.5-VL use 14-pixel patches (mean/std of CLIP), Qwen3-VL / Qwen3.5 16-pixel ones (0.5 / 0.5)
PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_5": 16}
MERGE, TEMPORAL_PATCH = 2, 2
IMAGE_SIZES = [(56, 84), (112, 112), (96, 200), (180, 120), (224, 160), (64, 256), (150, 150)]


# --------------------------------------------------------------------------- tokens


class ChatTokens:
    """The bundled demo tokenizer plus the Qwen-VL vision tokens, appended after its vocabulary."""

    def __init__(self):
        from tokenizers import Tokenizer

        from thdpack.demo import TOKENIZER_DIR

        self.tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
        base = self.tok.get_vocab_size()
        self.vision_start, self.vision_end, self.image_pad, self.video_pad = base, base + 1, base + 2, base + 3
        self.vocab_size = base + 4
        self.im_end = self.tok.token_to_id("<|im_end|>")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def image(self, grid_thw) -> list[int]:
        """``<|vision_start|>``, ``t·h·w / merge²`` image placeholders, ``<|vision_end|>``."""
        t, h, w = (int(v) for v in grid_thw)
        return [self.vision_start] + [self.image_pad] * (t * h * w // MERGE**2) + [self.vision_end]


def chat_sample(tokens: ChatTokens, question: str, answer: str, image_grids, max_text: int = 40) -> dict:
    """``input_ids`` / ``labels`` of one conversation: system, user (images, then the
    question), assistant answer. Only the answer and its ``<|im_end|>`` are scored."""
    prompt = tokens.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    for grid in image_grids:
        prompt += tokens.image(grid)
    prompt += tokens.encode(question)[:max_text] + tokens.encode("<|im_end|>\n<|im_start|>assistant\n")
    response = tokens.encode(answer)[:max_text] + [tokens.im_end]
    end = tokens.encode("\n")
    ids = prompt + response + end
    labels = [IGNORE] * len(prompt) + response + [IGNORE] * len(end)
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}


# --------------------------------------------------------------------------- images


def make_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A uint8 ``[height, width, 3]`` image: a gradient, checkerboard, stripes, rings or noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    kind = rng.integers(5)
    if kind == 0:
        img = np.stack([x / width, y / height, 1 - x / width], -1)
    elif kind == 1:
        cell = int(rng.integers(4, 24))
        board = ((x // cell + y // cell) % 2)[..., None]
        img = board * rng.random(3) + (1 - board) * rng.random(3)
    elif kind == 2:
        img = (0.5 + 0.5 * np.sin((x * rng.random() + y * rng.random()) / 3.0))[..., None] * rng.random(3)
    elif kind == 3:
        r = np.hypot(x - width / 2, y - height / 2)
        img = (0.5 + 0.5 * np.cos(r / 4.0))[..., None] * np.array([1.0, 0.6, 0.2])
    else:
        img = rng.random((height, width, 3))
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)


def image_processor(family: str):
    """The family's image processor, built locally with a small pixel budget (4..64 merged
    patches per image). Without torchvision, transformers' PIL backend of the same processor."""
    import transformers

    try:
        import torchvision  # noqa: F401

        cls = transformers.Qwen2VLImageProcessor
    except ImportError:
        cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    unit = PATCH[family] * MERGE  # pixels per merged patch side
    extra = {} if family in ("qwen2_vl", "qwen2_5_vl") else {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    return cls(
        patch_size=PATCH[family],
        temporal_patch_size=TEMPORAL_PATCH,
        merge_size=MERGE,
        min_pixels=4 * unit * unit,
        max_pixels=64 * unit * unit,
        **extra,
    )


def make_samples(num_samples: int, family: str, tokens: ChatTokens, seed: int) -> list[dict]:
    """Chat samples with 0-2 generated images each (every fifth sample is text-only)."""
    from thdpack.demo import generate_rows

    rng = np.random.default_rng(seed)
    processor = image_processor(family)
    rows = generate_rows(num_samples, seed=seed)
    samples = []
    for i, row in enumerate(rows):
        question = next(m["content"] for m in row["messages"] if m["role"] == "user")
        answer = next(m["content"] for m in row["messages"] if m["role"] == "assistant")
        n_images = 0 if i % 5 == 4 else 1 + int(rng.random() < 0.3)
        images = [make_image(rng, *IMAGE_SIZES[rng.integers(len(IMAGE_SIZES))]) for _ in range(n_images)]
        vision = processor(images=images, return_tensors="pt") if images else {}
        grids = vision["image_grid_thw"].tolist() if images else []
        sample = chat_sample(tokens, question, answer, grids)
        if images:
            sample["pixel_values"] = vision["pixel_values"]  # [patches, 3·2·patch²]
            sample["image_grid_thw"] = vision["image_grid_thw"]  # [n_images, 3]
        samples.append(sample)
    return samples


# --------------------------------------------------------------------------- model


def tiny_config(family: str, tokens: ChatTokens):
    """A small config of ``family``: 2 text layers (hidden 64), a 2-block ViT (hidden 32)."""
    import transformers

    text = dict(
        vocab_size=tokens.vocab_size,
        **TINY_TEXT,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=tokens.im_end,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=PATCH[family],
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL_PATCH,
        out_hidden_size=64,
    )
    ids = dict(
        image_token_id=tokens.image_pad,
        video_token_id=tokens.video_pad,
        vision_start_token_id=tokens.vision_start,
        vision_end_token_id=tokens.vision_end,
    )
    if family == "qwen2_vl":
        vision = dict(vision, embed_dim=32, hidden_size=64, mlp_ratio=2)
        del vision["intermediate_size"], vision["out_hidden_size"]
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    elif family == "qwen2_5_vl":
        vision = dict(vision, window_size=112, fullatt_block_indexes=[1], tokens_per_second=2)
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    elif family == "qwen3_vl":
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True)
        vision = dict(vision, num_position_embeddings=256, deepstack_visual_indexes=[1])
        cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    elif family == "qwen3_5":
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True, partial_rotary_factor=1.0)
        text.update(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,  # a hybrid
                    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
        vision = dict(vision, num_position_embeddings=256)
        cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, **ids)
    else:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    cfg._attn_implementation = "sdpa"
    return cfg


def tiny_model(family: str, tokens: ChatTokens, seed: int):
    import transformers

    classes = {
        "qwen2_vl": "Qwen2VLForConditionalGeneration",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
        "qwen3_vl": "Qwen3VLForConditionalGeneration",
        "qwen3_5": "Qwen3_5ForConditionalGeneration",
    }
    torch.manual_seed(seed)
    model = getattr(transformers, classes[family])(tiny_config(family, tokens)).to(torch.float32)
    return packed_model(model)  # hybrid layers get the pack's sample boundaries (full-attention models: no layer wrapped)


@torch.no_grad()
def max_logit_diff(model, batch, samples, image_token_id: int) -> float:
    """Largest |packed - alone| logit over the pack's real tokens, every sample run alone."""
    kw = to_hf_kwargs(batch, include_labels=False, attn_implementation=model.config._attn_implementation)
    packed = model(**kw).logits[0]
    worst = 0.0
    for k, i in enumerate(batch.sample_index.tolist()):
        s = samples[i]
        ids = s["input_ids"][None]
        vision = {key: s[key] for key in ("pixel_values", "image_grid_thw") if key in s}
        alone = model(input_ids=ids, mm_token_type_ids=(ids == image_token_id).int(), use_cache=False, **vision).logits[0]
        a = int(batch.cu_seqlens_padded[k])
        worst = max(worst, (packed[a : a + ids.shape[1]] - alone).abs().max().item())
    return worst


# --------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2_5_vl", choices=FAMILIES)
    parser.add_argument("--num-samples", type=int, default=12)
    parser.add_argument("--pack-size", type=int, default=1024, help="token budget of a pack")
    parser.add_argument("--vision-budget", type=int, default=1024, help="ViT-patch budget of a pack")
    parser.add_argument("--pad-multiple", type=int, default=None, help="e.g. 16 for FP8, or 2*cp for context parallelism")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip the packed-vs-alone logits check")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (a tiny model runs fastest on one)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    tokens = ChatTokens()
    samples = make_samples(args.num_samples, args.family, tokens, args.seed)
    n_images = sum(int(s["image_grid_thw"].shape[0]) for s in samples if "image_grid_thw" in s)
    patches = vision_lengths(samples)
    print(
        f"{len(samples)} samples ({args.family}), {n_images} images through {type(image_processor(args.family)).__name__}: "
        f"{sum(s['input_ids'].numel() for s in samples)} tokens, {int(patches.sum())} ViT patches "
        f"({time.perf_counter() - t0:.2f}s)"
    )

    cfg = tiny_config(args.family, tokens)
    collate = ThdCollator(
        vlm=get_family(cfg), pack_size=args.pack_size, vision_budget=args.vision_budget, pad_multiple=args.pad_multiple
    )
    t0 = time.perf_counter()
    packs = collate(samples)
    print(f"\npacked in {1e3 * (time.perf_counter() - t0):.1f} ms; plan statistics:")
    print(packs.stats)
    print("\npack  samples  tokens  stream  images  patches  max_seqlen  Σ sᵢ² / T²")
    for k, b in enumerate(packs):
        grid = b.extras["image_grid_thw"]
        print(
            f"{k:>4}  {b.num_samples:>7}  {b.num_tokens:>6}  {b.num_padded_tokens:>6}  "
            f"{0 if grid is None else grid.shape[0]:>6}  {int(b.extras['sample_vision_patches'].sum()):>7}  "
            f"{b.max_seqlen:>10}  {seqlen_squared_sum(b) / b.num_padded_tokens**2:>10.3f}"
        )

    batch = packs[0]
    kw = to_hf_kwargs(batch, attn_implementation=cfg._attn_implementation)  # sdpa: its 4D document mask
    print("\nfirst pack as transformers kwargs: " + ", ".join(
        f"{k} {list(v.shape)}" if isinstance(v, torch.Tensor) else f"{k}={v}" for k, v in kw.items()
    ))

    model = tiny_model(args.family, tokens, args.seed)
    result = {"family": args.family, "num_packs": len(packs), "num_samples": len(samples)}
    if not args.no_check:
        model.eval()
        diff = max_logit_diff(model, batch, samples, tokens.image_pad)
        result["max_logit_diff"] = diff
        print(f"packed vs each sample alone: max |logit diff| {diff:.2e} over {batch.num_samples} samples")

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    t0 = time.perf_counter()
    out = model(**kw)
    out.loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        after = model(**kw).loss.item()
    loss = out.loss.item()
    result.update(loss=loss, loss_after=after, grad_norm=grad_norm, target_tokens=int(batch.loss_mask.sum()))
    print(
        f"one packed training step of a tiny {type(model).__name__} ({time.perf_counter() - t0:.2f}s): "
        f"loss {loss:.4f} over {result['target_tokens']} target tokens, grad norm {grad_norm:.3f}, "
        f"loss after the step {after:.4f}"
    )
    if not math.isfinite(loss):
        raise SystemExit(f"non-finite loss {loss}")
    return result


if __name__ == "__main__":
    main()
