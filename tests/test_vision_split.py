"""The vision tower split over context-parallel ranks (issue 34): ``plan_vision_split``,
``vision_rank_inputs``, ``gather_vision_embeddings``, ``shard_vision_rows``.

* Real ``gloo`` groups (one fork of 4 processes; the cp=2 cases on 2-process subgroups of it, as CP groups
  are inside data parallelism): tiny random float64 Qwen2-VL, Qwen2.5-VL (windows), Qwen3-VL (deepstack)
  and Qwen3.5 towers on packs of images and videos of mixed sizes (an image with two temporal patches, a
  4-frame video, ...): every rank's gathered embeddings and deepstack features equal the whole tower run as
  transformers runs it (images, then videos), a loss that every rank computes on the vision rows of its
  own text-stream CP shard (``thdpack.shard``) sums to the loss on the whole stream, and the tower's
  parameter gradients summed over the ranks equal the whole tower's; with fewer frames than ranks (empty
  ranks with a placeholder frame, and without one: ``[0, D]`` blocks); errors raised on every rank alike.
* The gathered embeddings fed to each real transformers model (``mm_encoder_outputs``) give the logits of
  the model's own call on the pixels.
* The plan alone: the least largest rank cost over all contiguous splits (against brute force), the
  rows / grids / tokens of every rank for a pack, the costs against ``thdpack.flops``' vision terms
  (windows for Qwen2.5-VL), fewer frames than ranks.
* The peers: Megatron-Bridge 0.6.2's own ``qwen3vl_cp_split`` and NeMo Automodel 0.7.0's own
  ``_contiguous_balanced_bounds`` (read from their wheels; without a package index those tests skip, their
  ids ending ``-missing``) give the splits the benchmark charges them with (its written rules in
  ``benchmarks/vision_balance.py``, also checked on the examples the peers document), and on realistic packs
  thdpack's largest rank is never above theirs.
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import os
import sys
import time
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import megatron_env  # noqa: E402
from transformers.modeling_outputs import BaseModelOutputWithPooling  # noqa: E402
from test_mrope_versions import _functions  # noqa: E402
from test_vlm import FAMILIES, MODEL_CLASSES, make_sample, tiny_config  # noqa: E402

import thdpack  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.flops import model_flops_breakdown, vision_seqlen_stats  # noqa: E402
from thdpack.vlm import (VisionSplit, get_family, gather_vision_embeddings, plan_vision_split, shard_vision_rows,  # noqa: E402
                         vision_rank_inputs)
from thdpack.planning.vision_split import VisionCost, balanced_cuts, sample_vision_costs  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import vision_balance as bench  # noqa: E402

WORLD = 4
D = 64  # out_hidden_size of every tiny tower
CACHE = Path(os.environ.get("THDPACK_CACHE", Path.home() / ".cache" / "thdpack")) / "automodel-wheels"
AUTOMODEL = "nemo-automodel==0.7.0"

MIXED = [  # images first / videos after is the plan's order; the stream interleaves them
    [("text", 3), ("image", (1, 4, 4)), ("text", 2)],
    [("text", 2), ("video", (4, 6, 8)), ("text", 3)],
    [("text", 1), ("image", (1, 12, 8)), ("text", 1), ("image", (1, 2, 2)), ("text", 2)],
    [("text", 5)],
    [("text", 2), ("image", (2, 4, 6)), ("text", 1), ("video", (2, 2, 6)), ("text", 1), ("video", (1, 4, 2)),
     ("text", 2)],
]
FEW = [[("text", 2), ("image", (1, 4, 6)), ("text", 1), ("video", (1, 2, 2)), ("text", 2)]]  # 2 frames


# --------------------------------------------------------------------------- models and packs


@functools.lru_cache(maxsize=None)
def tiny_model(family: str) -> torch.nn.Module:
    """The tiny test model of ``family`` in float64 (the whole model: the end-to-end check runs it)."""
    torch.manual_seed(77)
    return getattr(transformers, MODEL_CLASSES[family])(tiny_config(family)).to(torch.float64).eval()


@functools.lru_cache(maxsize=None)
def pack(family: str, name: str):
    """A batch of ``MIXED`` / ``FEW`` (cp_size=4: its shards serve cp 2 too), pixels in float64."""
    rng = np.random.default_rng(5)
    torch.manual_seed(5)
    samples = [make_sample(family, layout, rng) for layout in (MIXED if name == "mixed" else FEW)]
    batch = build_thd_batch(samples, vlm=get_family(tiny_config(family)), cp_size=WORLD)
    for key in ("pixel_values", "pixel_values_videos"):
        batch.extras[key] = batch.extras[key].to(torch.float64)
    return batch


def outputs(out) -> list[torch.Tensor]:
    """The merged embeddings and (Qwen3-VL) the deepstack features of a tower's output."""
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


def loss_weights(family: str, batch) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    n = 2 if family == "qwen3_vl" else 1
    return [torch.randn(batch.num_padded_tokens, D, generator=g, dtype=torch.float64) for _ in range(n)]


def stream_loss(rows: list[torch.Tensor], positions: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """A loss on vision rows at their stream positions (what a rank's text shard would compute)."""
    return sum((torch.tanh(x) * w[positions]).sum() for x, w in zip(rows, weights))


def cases() -> dict:
    """``{name: (family, pack, cp, ranks of its group, placeholder)}``, every rank walking them in order."""
    out = {}
    for family in FAMILIES:
        out[f"{family}/mixed/cp4"] = (family, "mixed", 4, (0, 1, 2, 3), True)
        out[f"{family}/mixed/cp2"] = (family, "mixed", 2, (0, 1), True)
        out[f"{family}/few/cp2"] = (family, "few", 2, (2, 3), True)
        out[f"{family}/few/cp4"] = (family, "few", 4, (0, 1, 2, 3), True)
    out["qwen3_vl/few/cp4/no-placeholder"] = ("qwen3_vl", "few", 4, (0, 1, 2, 3), False)
    return out


# --------------------------------------------------------------------------- the gloo workers


def run_case(case, rank: int, group) -> dict:
    family, name, cp, _, placeholder = case
    model, batch = tiny_model(family), pack(family, name)
    tower = model.model.visual
    plan = plan_vision_split(batch, cp, model.config, placeholder=placeholder)
    tower.zero_grad(set_to_none=True)
    n_out = 2 if family == "qwen3_vl" else 1
    if plan.is_empty(rank) and not placeholder:
        local = [torch.zeros(0, D, dtype=torch.float64) for _ in range(n_out)]
    else:
        pixels, grid = vision_rank_inputs(batch, plan, rank)
        local = outputs(tower(pixels, grid_thw=grid))
    full = gather_vision_embeddings(local, plan, group)
    shard = thdpack.shard(batch, cp_size=cp, cp_rank=rank)
    loss = stream_loss(shard_vision_rows(full, shard, plan), shard.extras["vision_token_positions"],
                       loss_weights(family, batch))
    loss.backward()
    grads = {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in tower.named_parameters()}
    return dict(full=[f.detach() for f in full], loss=loss.detach(), grads=grads, local_rows=int(local[0].shape[0]))


def error_cases(rank: int, group) -> list[str]:
    """Each raises on every rank (no rank left waiting): a plan for another group size, and a wrong
    row count on one rank only (the others learn of it in the gather)."""
    messages = []
    batch, config = pack("qwen2_vl", "mixed"), tiny_config("qwen2_vl")
    for cp, extra_row in ((3, False), (WORLD, True)):
        plan = plan_vision_split(batch, cp, config)
        rows = int(plan.local_tokens[rank % cp]) + (1 if extra_row and rank == 1 else 0)
        try:
            gather_vision_embeddings(torch.zeros(rows, D), plan, group)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1, 2, 3), (0, 1), (2, 3))}
        results = {"errors": error_cases(rank, groups[0, 1, 2, 3])}
        for name, case in cases().items():
            if rank in case[3]:
                results[name] = run_case(case, case[3].index(rank), groups[case[3]])
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(out_dir: Path, deadline_s: float = 120.0) -> None:
    import torch.multiprocessing as mp

    context = mp.start_processes(_worker, args=(str(out_dir / "init"), str(out_dir)), nprocs=WORLD, join=False,
                                 start_method="fork")
    end = time.monotonic() + deadline_s
    while not context.join(timeout=1.0):
        if time.monotonic() > end:
            for process in context.processes:
                process.kill()
            raise AssertionError(f"the gloo workers did not finish within {deadline_s} s (a rank left waiting?)")


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """The workers' results, one fork per test session: under pytest-xdist the first xdist worker to get
    here runs the 4 processes and the other reads their files (the session's shared temporary folder)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        tmp = tmp_path_factory.getbasetemp().parent / "vision_split_gloo"  # this session's, shared by workers
        tmp.mkdir(exist_ok=True)
    else:
        tmp = tmp_path_factory.mktemp("vision_split_gloo")
    with open(tmp / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (tmp / "done").exists():
            for family in FAMILIES:  # built before the fork: the workers inherit them
                tiny_model(family)
                for name in ("mixed", "few"):
                    pack(family, name)
            _spawn(tmp)
            (tmp / "done").touch()
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def reference(family: str, name: str) -> dict:
    """The whole tower as transformers runs it (images, then videos), the loss on the whole stream, its gradients."""
    model, batch = tiny_model(family), pack(family, name)
    tower = model.model.visual
    tower.zero_grad(set_to_none=True)
    ex = batch.extras
    image = outputs(tower(ex["pixel_values"], grid_thw=ex["image_grid_thw"]))
    video = outputs(tower(ex["pixel_values_videos"], grid_thw=ex["video_grid_thw"]))
    types = batch.token_extras["mm_token_type_ids"]
    rows = []
    for i, v in zip(image, video):
        stream = torch.zeros(batch.num_padded_tokens, D, dtype=torch.float64)
        stream[types == 1] = i
        stream[types == 2] = v
        rows.append(stream[types != 0])
    loss = stream_loss(rows, torch.nonzero(types != 0).flatten(), loss_weights(family, batch))
    loss.backward()
    grads = {k: p.grad.clone() for k, p in tower.named_parameters()}
    tower.zero_grad(set_to_none=True)
    return dict(full=[torch.cat([i, v]).detach() for i, v in zip(image, video)], loss=loss.detach(), grads=grads)


@pytest.mark.parametrize("name", list(cases()))
def test_split_tower_equals_the_whole_tower(gloo_results, name):
    family, which, cp, ranks, placeholder = cases()[name]
    got = [gloo_results[r][name] for r in ranks]
    want = reference(family, which)
    plan = plan_vision_split(pack(family, which), cp, tiny_config(family), placeholder=placeholder)
    assert [g["local_rows"] for g in got] == plan.local_tokens.tolist()
    assert len(want["full"]) == (2 if family == "qwen3_vl" else 1)  # deepstack gathered beside the embeddings
    for g in got:  # every rank holds the whole sequence, deepstack features included
        for a, b in zip(g["full"], want["full"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(sum(g["loss"] for g in got), want["loss"], rtol=1e-12, atol=1e-10)
    for key, grad in want["grads"].items():
        torch.testing.assert_close(sum(g["grads"][key] for g in got), grad, rtol=1e-9, atol=1e-10, msg=key)
    if which == "mixed":  # the work really is split: no rank alone holds the whole gradient
        key = next(iter(want["grads"]))
        assert all(not torch.allclose(g["grads"][key], want["grads"][key]) for g in got)


def test_fewer_frames_than_ranks_have_empty_ranks(gloo_results):
    plan = plan_vision_split(pack("qwen2_5_vl", "few"), 4, tiny_config("qwen2_5_vl"))
    assert plan.cuts.tolist() == [0, 1, 2, 2, 2] and plan.rank_tokens.tolist() == [6, 1, 0, 0]
    assert plan.local_tokens.tolist() == [6, 1, 1, 1]  # the placeholder frame's one token, dropped by the gather
    assert plan.rank_grid_thw(3).tolist() == [[1, 2, 2]] and plan.rank_grid_thw(1).tolist() == [[1, 2, 2]]
    pixels, grid = vision_rank_inputs(pack("qwen2_5_vl", "few"), plan, 2)
    assert pixels.shape == (4, pixels.shape[1]) and not pixels.any() and grid.tolist() == [[1, 2, 2]]
    bare = plan_vision_split(pack("qwen2_5_vl", "few"), 4, tiny_config("qwen2_5_vl"), placeholder=False)
    assert bare.local_tokens.tolist() == [6, 1, 0, 0] and bare.rank_grid_thw(3).shape == (0, 3)
    assert [r["qwen3_vl/few/cp4/no-placeholder"]["local_rows"] for r in gloo_results] == [6, 1, 0, 0]


def test_errors_raise_on_every_rank(gloo_results):
    for r in gloo_results:
        assert len(r["errors"]) == 2, r["errors"]
        assert "the process group has 4 ranks but the plan is for cp_size=3" in r["errors"][0]
    assert "rank 1's tower output has" in gloo_results[1]["errors"][1]
    assert all("rank(s) [1]" in r["errors"][1] for i, r in enumerate(gloo_results) if i != 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_gathered_embeddings_drive_the_model(gloo_results, family):
    """transformers' own model with ``mm_encoder_outputs`` = rank 0's gathered embeddings (and deepstack
    features) gives the logits of its call on the pixels."""
    model, batch = tiny_model(family), pack(family, "mixed")
    plan = plan_vision_split(batch, 4, model.config)
    full = gloo_results[0][f"{family}/mixed/cp4"]["full"]
    n = plan.num_image_tokens
    encoder = {}
    for kind, part in (("image", slice(0, n)), ("video", slice(n, None))):
        if family == "qwen3_vl":
            from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

            encoder[kind] = BaseModelOutputWithDeepstackFeatures(
                pooler_output=(full[0][part],), deepstack_features=[(f[part],) for f in full[1:]])
        else:
            encoder[kind] = BaseModelOutputWithPooling(pooler_output=(full[0][part],))
    kw = to_hf_kwargs(batch, include_labels=False)
    with torch.no_grad():
        want = model(**kw, use_cache=False).logits
        for key in ("pixel_values", "pixel_values_videos"):
            kw.pop(key)
        got = model(**kw, mm_encoder_outputs=encoder, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


# --------------------------------------------------------------------------- the plan alone


def test_balanced_cuts_reach_the_least_bottleneck():
    rng = np.random.default_rng(0)
    for _ in range(400):
        n, parts = int(rng.integers(0, 9)), int(rng.integers(1, 5))
        costs = rng.integers(0, 20, n) * (rng.random(n) < 0.9)
        cuts = balanced_cuts(costs, parts)
        prefix = np.concatenate([[0], np.cumsum(costs)])
        assert cuts[0] == 0 and cuts[-1] == n and (np.diff(cuts) >= 0).all()
        if n >= parts:
            assert (np.diff(cuts) >= 1).all()
        best = min(max(prefix[b] - prefix[a] for a, b in zip((0, *c), (*c, n)))
                   for c in itertools.combinations_with_replacement(range(n + 1), parts - 1))
        assert max(prefix[cuts[1:]] - prefix[cuts[:-1]]) == best
    assert balanced_cuts([9, 4, 3, 3, 3, 3, 5, 5], 3).tolist() == [0, 2, 6, 8]  # the module docstring's drawing
    assert balanced_cuts([5, 1], 4).tolist() == [0, 1, 2, 2, 2]


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_rows_grids_and_tokens(family):
    batch, config = pack(family, "mixed"), tiny_config(family)
    ex = batch.extras
    frames = [[1, h, w] for g in (ex["image_grid_thw"], ex["video_grid_thw"])
              for t, h, w in g.tolist() for _ in range(t)]
    types = batch.token_extras["mm_token_type_ids"]
    for cp in (1, 2, 3, 4, 8, 12, 13, 16):
        plan = plan_vision_split(batch, cp, config)
        assert plan.num_units == len(frames) == 12
        grids = [plan.rank_grid_thw(r) for r in range(cp) if not plan.is_empty(r)]
        expanded = [[1, h, w] for g in grids for t, h, w in g.tolist() for _ in range(t)]
        assert expanded == frames
        rows = [plan.rank_pixel_rows(r) for r in range(cp)]
        for kind, total in ((0, ex["pixel_values"].shape[0]), (1, ex["pixel_values_videos"].shape[0])):
            ranges = [r[kind] for r in rows]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert plan.rank_tokens.sum() == int((types != 0).sum()) and plan.num_image_tokens == int((types == 1).sum())
        busy = plan.rank_tokens[plan.cuts[1:] > plan.cuts[:-1]]
        assert [int(g.prod(1).sum()) // 4 for g in grids] == busy.tolist()
        assert plan.is_empty(cp - 1) == (cp > 12)


@pytest.mark.parametrize("family", FAMILIES)
def test_costs_are_the_flops_vision_terms(family):
    """A frame's cost is its share of ``thdpack.flops``' vision FLOPs: the units of a pack add up to the terms
    of the pack's grids (training FLOPs of the tower)."""
    batch, config = pack(family, "mixed"), tiny_config(family)
    plan = plan_vision_split(batch, 2, config)
    grid = np.concatenate([batch.extras["image_grid_thw"].numpy(), batch.extras["video_grid_thw"].numpy()])
    terms = model_flops_breakdown(config, 0, 0, vision_grid_thw=grid)
    assert int(plan.unit_cost.sum()) == sum(v for k, v in terms.items() if k.startswith("vision"))
    assert plan.rank_costs.sum() == plan.unit_cost.sum() and plan.straggler >= 1.0
    cost = VisionCost.from_config(config)
    stats = vision_seqlen_stats([[1, 12, 8]], config)
    assert cost.unit_costs([[12, 8]]) == [cost.per_patch * 96 + cost.per_frame_square * 96**2
                                          + cost.per_window_square * stats.window_seqlen_squared_sum]
    if family == "qwen2_5_vl":  # window blocks: their attention over windows, not the frame
        assert cost.per_window_square > 0 and 0 < stats.window_seqlen_squared_sum < 96**2
    else:
        assert cost.per_window_square == 0


def test_plan_leaves_the_batch_and_its_shards_unchanged():
    batch = pack("qwen3_vl", "mixed")
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.extras.items()}
    shard_before = thdpack.shard(batch, cp_size=2, cp_rank=1)
    plan = plan_vision_split(batch, 4, tiny_config("qwen3_vl"))
    for r in range(4):
        vision_rank_inputs(batch, plan, r)
    assert batch.extras.keys() == before.keys()
    for k, v in before.items():
        assert (torch.equal(v, batch.extras[k]) if isinstance(v, torch.Tensor) else v == batch.extras[k]), k
    shard = thdpack.shard(batch, cp_size=2, cp_rank=1)
    assert shard.extras.keys() == shard_before.extras.keys()
    for k in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(shard, k), getattr(shard_before, k))
    assert torch.equal(shard.shard.partition_indices, shard_before.shard.partition_indices)


def test_plan_errors_and_edges():
    config = tiny_config("qwen2_vl")
    with pytest.raises(ValueError, match=r"image_grid_thw\[0\] = \[1, 3, 4\]"):
        plan_vision_split({"image_grid_thw": [[1, 3, 4]]}, 2, config)
    with pytest.raises(ValueError, match="cp_size must be an integer >= 1"):
        plan_vision_split({}, 0, config)
    with pytest.raises(ValueError, match="no vision_config"):
        plan_vision_split({}, 2, {"model_type": "qwen3", "hidden_size": 8})
    with pytest.raises(TypeError, match="ThdBatch or a mapping"):
        plan_vision_split([1, 2], 2, config)
    empty = plan_vision_split({"image_grid_thw": None}, 4, config)
    assert isinstance(empty, VisionSplit) and empty.num_units == 0 and empty.local_tokens.tolist() == [0] * 4
    assert vision_rank_inputs({}, empty, 0) is None and empty.straggler == 1.0
    one = plan_vision_split({"image_grid_thw": [[1, 2, 4]]}, 1, config)
    x = torch.randn(2, D, requires_grad=True)
    assert torch.equal(gather_vision_embeddings(x, one, None), x)
    with pytest.raises(ValueError, match="rank 0's tower output has 3 rows but the plan gives it 2"):
        gather_vision_embeddings(torch.zeros(3, D), one)
    with pytest.raises(RuntimeError, match="initialise torch.distributed"):
        gather_vision_embeddings(torch.zeros(1, D), plan_vision_split({"image_grid_thw": [[2, 2, 2]]}, 2, config))


# --------------------------------------------------------------------------- the peers' own code


def automodel_bounds():
    """NeMo Automodel 0.7.0's ``_contiguous_balanced_bounds`` (and what it calls), or why it cannot be had."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(CACHE.glob("nemo_automodel-0.7.0-*.whl"))
        if not found:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "--dest",
                   str(CACHE / "download"), AUTOMODEL]
            failed = megatron_env.pip_download(CACHE, cmd, AUTOMODEL)
            got = sorted((CACHE / "download").glob("nemo_automodel-0.7.0-*.whl"))
            if failed or not got:
                return failed or f"`pip download {AUTOMODEL}` gave no wheel"
            os.replace(got[0], CACHE / got[0].name)
            found = [CACHE / got[0].name]
    path = "nemo_automodel/components/distributed/cp_vision_frame_shard.py"
    with zipfile.ZipFile(found[0]) as z:
        source = z.read(path).decode()
    names = ("_contiguous_balanced_bounds", "_vision_cost_alpha", "_infer_vision_hidden_size", "_config_value")
    funcs = _functions(source, names, f"{found[0].name}:{path}")
    glob = funcs["_contiguous_balanced_bounds"].__globals__  # one namespace for the four
    glob.update(Mapping=__import__("collections.abc").abc.Mapping, _LOGGED_COST_ALPHAS=set(),
                logger=types.SimpleNamespace(info=lambda *a, **k: None))
    return funcs["_contiguous_balanced_bounds"]


def bridge_count_split():
    """Megatron-Bridge 0.6.2's ``qwen3vl_cp_split`` (``vision_dp_when_cp``), or why it cannot be had."""
    site = megatron_env.site_or_reason()
    if isinstance(site, str):
        return site
    path = site / "megatron" / "bridge" / "models" / "qwen_vl" / "modelling_qwen3_vl" / "utils.py"
    names = ("qwen3vl_cp_split", "qwen2vl_pad_and_split", "expand_thw")
    return _functions(path.read_text(), names, str(path))["qwen3vl_cp_split"]


def realistic_packs(n: int = 60):
    rng = np.random.default_rng(3)
    return [bench.draw_pack(rng, 32, 16384) for _ in range(n)]


def test_written_rules_on_their_documented_examples():
    """The benchmark's written rules of the peers (checked against the peers' own code below, where
    their wheels are here) on the examples their code documents."""
    assert bench.count_cuts(10, 4).tolist() == [0, 3, 6, 8, 10]
    assert bench.automodel_cuts([4, 4, 4, 4], 2, 0).tolist() == [0, 2, 4]


@pytest.mark.parametrize("split", [megatron_env.peer_param(bridge_count_split(), megatron_env.SITE_ID)])
def test_bridge_rule_is_its_own_code(split):
    for p in realistic_packs(20):
        grid = torch.from_numpy(np.concatenate([p["image_grid_thw"], p["video_grid_thw"]]))
        pixels = torch.zeros(int(grid.prod(1).sum()), 1)
        for cp in (2, 4, 8):
            _, _, per_rank, padded = split(cp, pixels, grid)
            assert not any(padded)
            assert np.diff(bench.count_cuts(int(grid[:, 0].sum()), cp)).tolist() == list(per_rank)


@pytest.mark.parametrize("bounds", [megatron_env.peer_param(automodel_bounds(), "nemo-automodel-0.7.0")])
def test_automodel_rule_is_its_own_code(bounds):
    for p in realistic_packs(20):
        split = plan_vision_split(p, 1, bench.MODELS["Qwen3-VL-8B"])
        for cp in (2, 4, 8):
            alpha = bench.vision_alpha(bench.MODELS["Qwen3-VL-8B"])
            theirs = bounds(torch.from_numpy(split.unit_rows), cp, cost_alpha_source=None,
                            config=types.SimpleNamespace(cost_alpha=alpha))
            assert bench.automodel_cuts(split.unit_rows, cp, alpha).tolist() == theirs


@pytest.mark.parametrize("model", list(bench.MODELS))
def test_thdpack_is_never_behind_the_peers(model):
    """On the benchmark's packs the largest rank (FLOPs) of the plan is at most the count rule's and
    Automodel's, and below both on average (all three are contiguous splits; the plan is the least)."""
    config = bench.MODELS[model]
    cost = VisionCost.from_config(config)
    rng = np.random.default_rng(9)
    factor = int(config["vision_config"]["patch_size"]) * cost.spatial_merge_size
    ours, count, am = [], [], []
    for p in (bench.draw_pack(rng, factor, 16384) for _ in range(40)):
        for cp in (2, 4, 8):
            split = plan_vision_split(p, cp, cost)
            ours.append(split.rank_costs.max())
            count.append(bench.rank_costs(split.unit_cost, bench.count_cuts(split.num_units, cp)).max())
            am.append(bench.rank_costs(split.unit_cost,
                                       bench.automodel_cuts(split.unit_rows, cp, bench.vision_alpha(config))).max())
    ours, count, am = map(np.array, (ours, count, am))
    assert (ours <= count).all() and (ours <= am).all()
    assert ours.mean() < 0.97 * am.mean() and ours.mean() < 0.9 * count.mean()


def test_sample_vision_costs_are_their_frames():
    """The per-sample cost (for a data-parallel balance of whole samples) is the sum of the sample's frames."""
    config = tiny_config("qwen2_5_vl")
    rng = np.random.default_rng(2)
    samples = [make_sample("qwen2_5_vl", layout, rng) for layout in MIXED]
    costs = sample_vision_costs(samples, config)
    for sample, cost in zip(samples, costs.tolist()):
        plan = plan_vision_split(sample, 3, config)
        assert cost == int(plan.unit_cost.sum())
    assert costs[3] == 0 and (costs[[0, 1, 2, 4]] > 0).all()
