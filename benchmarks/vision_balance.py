"""Benchmark: how evenly the vision tower's work is spread over context-parallel ranks, by four rules, and
what the split saves on a CPU.

    python benchmarks/vision_balance.py                    # 200 packs, cp 2 4 8, Qwen2.5-VL-7B and Qwen3-VL-8B
    python benchmarks/vision_balance.py --packs 50 --cp 2 4 --tower-repeats 1

Packs (seed ``--seed``): items drawn until the next would pass ``--budget`` merged vision tokens (16,384):
images (65%) of 224 to 1344 pixels a side, videos (35%) of 8 to 64 frames (4 to 32 temporal patches) of
224 to 672 pixels a side, sides rounded to the model's ``patch · merge`` (28 for Qwen2.5-VL, 32 for
Qwen3-VL). A unit is one frame (temporal patch) of an image or video. Rules, each giving every CP rank
a set of units:

  none       every rank encodes every unit (thdpack's CP shards without the vision split)
  count      Megatron-Bridge 0.6.2's ``vision_dp_when_cp`` (Qwen3-VL / Qwen3.5-VL): videos cut into frames,
             ``n // cp`` consecutive frames per rank, one more for the first ``n % cp`` ranks
  automodel  NeMo Automodel's frame sharding (PR #2990, ``cp_vision_frame_shard.py`` in 0.7.0):
             cost ``p·(p + α)`` per frame of ``p`` patches, ``α = 3 ×`` vision hidden size; cut ``k``
             after the last frame whose running cost is at most ``k·total / cp``, at least one frame per rank
  thdpack    ``plan_vision_split``: the FLOPs of each frame (``thdpack.flops``: per patch, full
             attention per frame, Qwen2.5-VL's windows), the least largest rank over all contiguous splits

All rules cut the same order of frames (thdpack's: images, then videos; Bridge orders a pack's items as
its stream does, which these packs, having no text, do not fix). Every rule is measured with the same
cost, the training FLOPs of each frame of the model's tower (:class:`thdpack.planning.vision_split.VisionCost`);
the table gives the most loaded rank's cost over the even share ``total / cp`` (mean and worst over the
packs; "bound" is the least any split of whole frames could reach, ``max(largest frame, total / cp)``, not
always reachable). ``none`` is ``cp`` by definition. "plan µs": ``plan_vision_split`` per pack.

Then the CPU: a tiny random Qwen2.5-VL tower (transformers; hidden 64, 4 blocks, 2 of them windowed),
one thread, on ``--tower-packs`` smaller packs (images 8 to 48 patches a side, videos of 2 to 8 temporal
patches of 8 to 24 a side): the whole tower on the pack (as every rank runs it without the split) against
each rank's share under the thdpack plan and under the count rule, the slowest rank's CPU time (process
time, median of ``--tower-repeats``). The shares' outputs put together must equal the whole tower's
(exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from thdpack.planning.vision_split import VisionCost, plan_vision_split

TEXT = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "intermediate_size": 18944, "vocab_size": 152064}
MODELS = {
    "Qwen2.5-VL-7B": {
        "model_type": "qwen2_5_vl", "text_config": dict(TEXT, model_type="qwen2_5_vl_text"),
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                          "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                          "fullatt_block_indexes": [7, 15, 23, 31]}},
    "Qwen3-VL-8B": {
        "model_type": "qwen3_vl",
        "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 4096, "num_hidden_layers": 36,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                        "intermediate_size": 12288, "vocab_size": 151936},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                          "out_hidden_size": 4096, "hidden_act": "gelu_pytorch_tanh",
                          "deepstack_visual_indexes": [8, 16, 24]}},
}


# --------------------------------------------------------------------------- the peers' rules (our code)


def count_cuts(n: int, cp: int) -> np.ndarray:
    """Megatron-Bridge's rule: ``n // cp`` consecutive frames per rank, the first ``n % cp`` ranks one more."""
    per = np.full(cp, n // cp, np.int64)
    per[: n % cp] += 1
    return np.concatenate([[0], np.cumsum(per)])


def automodel_cuts(patches, cp: int, alpha: int) -> np.ndarray:
    """NeMo Automodel's rule: cost ``p·(p + α)``; cut ``k`` after the last frame whose running cost is at
    most ``k·total / cp``, kept between one frame for the rank before and one for each rank after. With
    fewer frames than ranks (Automodel pads with one-token dummy frames) one frame per rank."""
    p = np.asarray(patches, dtype=np.int64)
    n = p.size
    if n < cp:
        return np.concatenate([np.arange(n + 1), np.full(cp - n, n)])
    running = np.cumsum(p * (p + alpha))
    cuts = [0]
    for k in range(1, cp):
        j = int(np.searchsorted(running, running[-1] * k / cp, side="right"))
        cuts.append(max(cuts[-1] + 1, min(j, n - (cp - k))))
    return np.array(cuts + [n], np.int64)


def vision_alpha(config) -> int:
    return 3 * int(config["vision_config"]["hidden_size"])


# --------------------------------------------------------------------------- packs


def draw_pack(rng, factor: int, budget: int, merge: int = 2) -> dict:
    """``{"image_grid_thw", "video_grid_thw"}`` of one pack: items until the next would pass ``budget``
    merged tokens (a side of ``s`` pixels is ``round(s / factor) · merge`` patches)."""
    images, videos, tokens = [], [], 0
    while True:
        if rng.random() < 0.65:
            h, w = (max(1, round(s / factor)) * merge for s in rng.integers(224, 1345, 2))
            item, kind = [1, h, w], images
        else:
            t = int(rng.integers(4, 33))
            h, w = (max(1, round(s / factor)) * merge for s in rng.integers(224, 673, 2))
            item, kind = [t, h, w], videos
        cost = item[0] * item[1] * item[2] // merge**2
        if tokens + cost > budget and (images or videos):
            break
        kind.append(item)
        tokens += cost
    return {"image_grid_thw": np.array(images or np.zeros((0, 3)), np.int64).reshape(-1, 3),
            "video_grid_thw": np.array(videos or np.zeros((0, 3)), np.int64).reshape(-1, 3)}


def rank_costs(unit_cost: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    prefix = np.concatenate([[0], np.cumsum(unit_cost)])
    return prefix[cuts[1:]] - prefix[cuts[:-1]]


def balance_table(args) -> None:
    print(f"most loaded CP rank's vision FLOPs / even share, {args.packs} packs of <= {args.budget} vision tokens")
    print(f"{'model':<14} {'cp':>3} {'none':>5} {'count mean/worst':>17} {'automodel mean/worst':>21} "
          f"{'thdpack mean/worst':>19} {'bound mean/worst':>17} {'plan µs':>8}")
    for name, config in MODELS.items():
        cost = VisionCost.from_config(config)
        factor = int(config["vision_config"]["patch_size"]) * cost.spatial_merge_size
        rng = np.random.default_rng(args.seed)
        packs = [draw_pack(rng, factor, args.budget) for _ in range(args.packs)]
        for cp in args.cp:
            ratios = {k: [] for k in ("count", "automodel", "thdpack", "bound")}
            plan_time = 0.0
            for pack in packs:
                start = time.perf_counter()
                split = plan_vision_split(pack, cp, cost)
                plan_time += time.perf_counter() - start
                even = split.unit_cost.sum() / cp
                ratios["thdpack"].append(split.rank_costs.max() / even)
                ratios["count"].append(rank_costs(split.unit_cost, count_cuts(split.num_units, cp)).max() / even)
                am = automodel_cuts(split.unit_rows, cp, vision_alpha(config))
                ratios["automodel"].append(rank_costs(split.unit_cost, am).max() / even)
                ratios["bound"].append(max(split.unit_cost.max(), even) / even)
            r = {k: np.array(v) for k, v in ratios.items()}
            print(f"{name:<14} {cp:>3} {cp:>5} {r['count'].mean():>8.3f}/{r['count'].max():<8.3f} "
                  f"{r['automodel'].mean():>10.3f}/{r['automodel'].max():<10.3f} "
                  f"{r['thdpack'].mean():>9.3f}/{r['thdpack'].max():<9.3f} "
                  f"{r['bound'].mean():>8.3f}/{r['bound'].max():<8.3f} "
                  f"{1e6 * plan_time / len(packs):>8.0f}")


# --------------------------------------------------------------------------- the tiny tower on a CPU


def tiny_tower():
    import transformers

    vision = dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, window_size=16,
                  fullatt_block_indexes=[1, 3], initializer_range=0.2)
    text = dict(vocab_size=128, bos_token_id=None, eos_token_id=None, hidden_size=64, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]})
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    return model.model.visual, config


def tiny_pack(rng) -> dict:
    images = [[1, *(2 * rng.integers(4, 25, 2))] for _ in range(int(rng.integers(2, 6)))]
    videos = [[int(rng.integers(2, 9)), *(2 * rng.integers(4, 13, 2))] for _ in range(int(rng.integers(1, 3)))]
    out = {"image_grid_thw": torch.tensor(images), "video_grid_thw": torch.tensor(videos)}
    out["pixel_values"] = torch.randn(int(out["image_grid_thw"].prod(1).sum()), 24)
    out["pixel_values_videos"] = torch.randn(int(out["video_grid_thw"].prod(1).sum()), 24)
    return out


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):  # CPU time of this process (one thread): what other load on the machine leaves alone
        start = time.process_time()
        out = fn()
        times.append(time.process_time() - start)
    return float(np.median(times)), out


@torch.no_grad()
def tower_table(args) -> bool:
    from thdpack.parallel.vision_gather import vision_rank_inputs

    torch.set_num_threads(1)
    tower, config = tiny_tower()
    rng = np.random.default_rng(args.seed)
    packs = [tiny_pack(rng) for _ in range(args.tower_packs)]
    print(f"\nCPU seconds of a tiny Qwen2.5-VL tower (1 thread), {len(packs)} packs, median of {args.tower_repeats}")
    print(f"{'cp':>3} {'whole pack':>11} {'thdpack slowest rank':>21} {'count slowest rank':>19} {'speedup':>8} "
          f"{'max |diff|':>11}")
    whole_time, wholes = 0.0, []
    for pack in packs:
        def whole(p=pack):
            return torch.cat([tower(p["pixel_values"], grid_thw=p["image_grid_thw"]).pooler_output,
                              tower(p["pixel_values_videos"], grid_thw=p["video_grid_thw"]).pooler_output])
        seconds, out = timed(whole, args.tower_repeats)
        whole_time += seconds
        wholes.append(out)
    ok = True
    for cp in args.cp:
        slowest = {"thdpack": 0.0, "count": 0.0}
        worst_diff = 0.0
        for pack, reference in zip(packs, wholes):
            split = plan_vision_split(pack, cp, config)
            for rule in ("thdpack", "count"):
                if rule == "count":
                    split = _with_cuts(split, count_cuts(split.num_units, cp))
                per_rank, outs = [], []
                for rank in range(cp):
                    pixels, grid = vision_rank_inputs(pack, split, rank)
                    seconds, out = timed(lambda: tower(pixels, grid_thw=grid).pooler_output, args.tower_repeats)
                    per_rank.append(seconds)
                    outs.append(out[: split.rank_tokens[rank]])
                slowest[rule] += max(per_rank)
                worst_diff = max(worst_diff, float((torch.cat(outs) - reference).abs().max()))
        ok &= worst_diff <= 1e-5
        print(f"{cp:>3} {whole_time:>11.3f} {slowest['thdpack']:>21.3f} {slowest['count']:>19.3f} "
              f"{whole_time / slowest['thdpack']:>7.2f}x {worst_diff:>11.2e}")
    return ok


def _with_cuts(split, cuts):
    import dataclasses

    return dataclasses.replace(split, cuts=np.asarray(cuts, np.int64))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packs", type=int, default=200)
    ap.add_argument("--budget", type=int, default=16384, help="merged vision tokens per pack")
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--tower-packs", type=int, default=8)
    ap.add_argument("--tower-repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    balance_table(args)
    ok = tower_table(args)
    print("thdpack: the ranks' shares put together equal the whole tower" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
