"""rebalance_steps and MegatronSteps at run time, against the offline plan and megatron-core's own code.

1. Four real ``gloo`` processes (one fork, every scenario inside the workers, results saved and checked here):
   each rank has its own skewed rollouts (rank 0 every long one, rank 2 none; with and without GRPO-style
   ``groups=``) and calls ``thdpack.rebalance_steps`` on the default group, with ``pp_size=4, vpp_size=2`` and
   with ``pp_size=2`` (and CP alignment). Checked here: the run-time plan is the offline
   ``thdpack.plan_steps`` of the same global batch (global ids number the ranks' samples rank by rank), fillers
   included; every rank reports the same ``num_micro_batches``; every sample is scored exactly once; the
   FLOPs statistics; and every pipeline stage's ``MegatronSteps`` dicts (the first stage tokens and positions,
   the last labels and loss mask, the middle ones, and the middle model chunks under VPP, the first stage's
   boundaries only). A sample too long on one rank: every rank raises the same one-line ``ValueError``.
2. megatron-core 0.19.2's own contract (the cached wheel, tests/megatron_env.py; skipped with the reason in
   the id where it cannot be had): ``forward_backward_kwargs`` against the signatures of its three
   ``forward_backward_*`` functions (read with ``ast``), the interleaved schedule's ``data_iterator[model_chunk_id]``,
   ``get_batch_on_this_tp_rank``'s batch keys, and ``get_batch_on_this_cp_rank`` (taken out of ``utils.py``
   with ``ast`` and run on thdpack's first- and last-stage dicts) cutting thdpack's own CP shards.
3. MegatronSteps' argument errors.
4. The checks themselves catch a reversed rank order and middle stages without boundaries.
"""

from __future__ import annotations

import ast
import functools
import types
import zlib
from typing import Any, Callable, Dict, Optional

import numpy as np
import pytest
import torch

import megatron_env  # tests/megatron_env.py
import thdpack
from thdpack import build_thd_batch, plan_steps, rebalance_steps
from thdpack.integrations import megatron_steps
from thdpack.integrations.megatron_steps import BATCH_KEYS, MegatronSteps, megatron_micro_batch

WORLD = 4
IGNORE = -100
VOCAB = 64
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
BOUNDARY_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")
PSP_FIELDS = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
              "max_seqlen_q", "max_seqlen_kv")


def rollouts(lengths, *, rank: int, seed: int) -> list[dict]:
    """Samples of ``rank``: random tokens, the first 2 labels masked."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    out = []
    for s in lengths:
        ids = torch.randint(1, VOCAB, (int(s),), generator=g)
        labels = ids.clone()
        labels[:2] = IGNORE
        out.append({"input_ids": ids, "labels": labels})
    return out


def scenario(name: str, rank: int) -> tuple[list[dict], dict]:
    """``(local samples, rebalance_steps keywords)`` of ``rank``; the workers and the checks make the same."""
    rng = np.random.default_rng([zlib.crc32(name.encode()), rank])
    if name == "vpp":  # rank 0 made every long rollout, rank 2 none
        lengths = {0: rng.integers(200, 500, 30), 1: rng.integers(5, 60, 40), 2: [], 3: rng.integers(5, 120, 40)}
        return rollouts(lengths[rank], rank=rank, seed=1), dict(max_tokens_per_micro_batch=512, pp_size=4,
                                                                 vpp_size=2, cost=(1, 1 / 512))
    if name == "grouped":  # GRPO: 6 prompts x 4 rollouts per rank (rank 0's long, rank 2 none), CP-aligned
        n = 0 if rank == 2 else 24
        lengths = rng.integers(30, 120, n) if rank == 0 else rng.integers(5, 40, n)
        groups = np.repeat(np.arange(n // 4), 4)
        return rollouts(lengths, rank=rank, seed=2), dict(max_tokens_per_micro_batch=256, pp_size=2,
                                                           cost=(1, 1 / 256), groups=groups, cp_size=2,
                                                           min_micro_batches=8)
    if name == "too_long":  # rank 1's local sample 3 alone is over the cap
        lengths = rng.integers(5, 60, 6)
        if rank == 1:
            lengths[3] = 600
        return rollouts(lengths, rank=rank, seed=3), dict(max_tokens_per_micro_batch=512, pp_size=2)
    raise KeyError(name)


SCENARIOS = ("vpp", "grouped")


def offline_plan(name: str):
    """``plan_steps`` of the scenario's global batch (rank r's local sample i is global sample offsets[r] + i)."""
    inputs = [scenario(name, r) for r in range(WORLD)]
    kwargs = dict(inputs[0][1])
    lengths = np.array([len(s["input_ids"]) for local, _ in inputs for s in local], np.int64)
    if "groups" in kwargs:  # group ids are per rank: rank r's group g is global group (r, g)
        kwargs["groups"] = np.concatenate([r * 1000 + np.asarray(kw["groups"], np.int64)
                                           for r, (_, kw) in enumerate(inputs)])
    if "cp_size" in kwargs:
        kwargs["align"] = 2 * kwargs.pop("cp_size")
    kwargs.pop("max_tokens_per_micro_batch")
    cap = inputs[0][1]["max_tokens_per_micro_batch"]
    offsets = np.concatenate([[0], np.cumsum([len(local) for local, _ in inputs])]).tolist()
    return plan_steps(lengths, dp_size=WORLD, max_tokens_per_micro_batch=cap, **kwargs), offsets


# --------------------------------------------------------------------------- stage dicts


def psp_fields(params) -> dict:
    return {k: megatron_env.field(params, k) for k in PSP_FIELDS}


def stage_records(batches, pp_size: int, vpp_size: int, num_micro_batches: int) -> dict:
    """``{(pp_rank, chunk): [dict per micro-batch]}``: what each stage's ``MegatronSteps`` iterators give
    (``packed_seq_params`` as its fields), and ``("iterators", pp_rank)``: the data_iterator's shape."""
    out = {}
    for p in range(pp_size):
        steps = MegatronSteps(batches, pp_rank=p, pp_size=pp_size, vpp_size=vpp_size,
                              num_micro_batches=num_micro_batches)
        kwargs = steps.forward_backward_kwargs()
        it = kwargs["data_iterator"]
        iterators = it if isinstance(it, list) else [it]
        out[("iterators", p)] = (type(it).__name__, len(iterators), kwargs["num_microbatches"],
                                 kwargs["seq_length"], kwargs["micro_batch_size"])
        for c, chunk in enumerate(iterators):
            out[(p, c)] = [{**d, "packed_seq_params": psp_fields(d["packed_seq_params"])} for d in chunk]
    return out


def check_stage_records(records: dict, batches, pp_size: int, vpp_size: int) -> None:
    """First stage: tokens and position_ids of the batch, no labels; last: labels and loss_mask, no tokens;
    every other (stage, chunk): no sequence tensors, the first stage's boundaries."""
    m = len(batches)
    for p in range(pp_size):
        kind = "list" if vpp_size > 1 else "generator"
        assert records[("iterators", p)] == (kind, vpp_size, m, max(int(b.cu_seqlens_padded[-1]) for b in batches), 1)
    first, last = records[(0, 0)], records[(pp_size - 1, vpp_size - 1)]
    for j, batch in enumerate(batches):
        f, l = first[j], last[j]
        assert set(f) == set(BATCH_KEYS)
        assert torch.equal(f["tokens"], batch.input_ids.long()[None])
        assert torch.equal(f["position_ids"], batch.position_ids.long()[None])
        assert f["labels"] is None and f["loss_mask"] is None and f["attention_mask"] is None
        assert l["tokens"] is None and l["position_ids"] is None and l["attention_mask"] is None
        assert torch.equal(l["labels"], torch.where(batch.loss_mask, batch.labels, 0).long()[None])
        assert torch.equal(l["loss_mask"], batch.loss_mask.float()[None])
        assert f["cu_seqlens"].dtype == torch.int32 and torch.equal(f["cu_seqlens"][0], batch.cu_seqlens.int())
        if batch.pad_multiple > 1:
            assert torch.equal(f["cu_seqlens_padded"][0], batch.cu_seqlens_padded.int())
        assert int(f["max_seqlen"]) == int(batch.max_seqlen) == int(f["packed_seq_params"]["max_seqlen_q"])
        assert torch.equal(f["packed_seq_params"]["cu_seqlens_q"], f["cu_seqlens"][0])
        for p in range(pp_size):
            for c in range(vpp_size):
                d = records[(p, c)][j]
                assert set(d) == set(BATCH_KEYS), (p, c, j)
                if (p, c) not in ((0, 0), (pp_size - 1, vpp_size - 1)):  # a middle stage or chunk
                    assert all(d[k] is None for k in SEQUENCE_KEYS), (p, c, j)
                for k in BOUNDARY_KEYS:
                    assert (d[k] is None) == (f[k] is None), (p, c, j, k)
                    assert d[k] is None or torch.equal(d[k], f[k]), (p, c, j, k)
                for k, v in f["packed_seq_params"].items():
                    w = d["packed_seq_params"][k]
                    assert (torch.equal(w, v) if isinstance(v, torch.Tensor) else w == v), (p, c, j, k)


def check_against_plan(name: str, outputs: list[dict], plan, offsets) -> None:
    """The run-time batches are the offline plan's, rank by rank, in run order."""
    m = plan.num_micro_batches
    tokens, squares = plan.seqlen_sums
    scored = []
    for r, o in enumerate(outputs):
        assert o["offsets"] == offsets
        assert o["num_micro_batches"] == m and len(o["sample_index"]) == m, (name, r)
        assert [s.tolist() for s in plan.micro_batches[r]] == o["sample_index"], (name, r)
        assert o["filler"] == plan.filler[r].tolist(), (name, r)
        assert o["seqlen_sums"] == (int(tokens[r]), int(squares[r])), (name, r)
        assert o["global_seqlen_sums"] == (int(tokens.sum()), int(squares.sum())), (name, r)
        lens = [b.seq_lens.long() for b in o["batches"]]
        assert o["seqlen_sums"] == (sum(int(s.sum()) for s in lens), sum(int((s * s).sum()) for s in lens))
        scored += [g for ids, f in zip(o["sample_index"], o["filler"]) if not f for g in ids]
    assert sorted(scored) == list(range(offsets[-1]))  # every sample scored exactly once


# --------------------------------------------------------------------------- 1. four gloo processes


def run_scenario(name: str) -> dict:
    samples, kwargs = scenario(name, torch.distributed.get_rank())
    batches, handle = rebalance_steps(samples, **kwargs)
    P, V = kwargs["pp_size"], kwargs.get("vpp_size", 1)
    return dict(batches=batches, sample_index=[b.sample_index.tolist() for b in batches],
                filler=handle.filler.tolist(), offsets=handle.offsets.tolist(),
                num_micro_batches=handle.num_micro_batches, seqlen_sums=handle.seqlen_sums,
                global_seqlen_sums=handle.global_seqlen_sums,
                stages=stage_records(batches, P, V, handle.num_micro_batches))


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {}
        samples, kwargs = scenario("too_long", rank)  # first: the group must still work after it
        try:
            rebalance_steps(samples, **kwargs)
            results["error"] = None
        except ValueError as exc:
            results["error"] = str(exc)
        for name in SCENARIOS:
            results[name] = run_scenario(name)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("pipeline_steps")
    for name in SCENARIOS:  # the planner's first run here, not in every fork
        offline_plan(name)
    mp.start_processes(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True, start_method="fork")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("name", SCENARIOS)
def test_runtime_plan_is_the_offline_plan(gloo_results, name):
    plan, offsets = offline_plan(name)
    check_against_plan(name, [r[name] for r in gloo_results], plan, offsets)
    if name == "grouped":  # the scenario is what it claims: fillers, and rank 2 (no samples) gets work
        assert plan.filler.any()
        assert not all(gloo_results[2][name]["filler"])
        gid = [(r, int(g)) for r in range(WORLD) for g in scenario(name, r)[1]["groups"]]
        ranks = {}
        for r, res in enumerate(gloo_results):  # a group runs on one rank
            for ids, f in zip(res[name]["sample_index"], res[name]["filler"]):
                for g in [] if f else ids:
                    ranks.setdefault(gid[g], set()).add(r)
        assert len(ranks) == len(set(gid)) and all(len(v) == 1 for v in ranks.values())


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_stage_reads_its_keys(gloo_results, name):
    _, kwargs = scenario(name, 0)
    P, V = kwargs["pp_size"], kwargs.get("vpp_size", 1)
    for res in gloo_results:
        check_stage_records(res[name]["stages"], res[name]["batches"], P, V)


def test_too_long_sample_raises_on_every_rank(gloo_results):
    messages = [r["error"] for r in gloo_results]
    assert messages[0] is not None and len(set(messages)) == 1, messages
    msg = messages[0]
    assert "\n" not in msg
    assert msg.startswith("rebalance: sample 3 of rank 1 has 600 tokens"), msg
    assert "max_tokens_per_micro_batch" in msg or "pack_size=512" in msg


# --------------------------------------------------------------------------- 2. megatron-core's contract


def _core_file(*parts):
    site = megatron_env.site_or_reason()
    if isinstance(site, str):
        return site
    path = site.joinpath("megatron", "core", *parts)
    return path if path.is_file() else f"{path} is missing"


SCHEDULES = megatron_env.peer_param(_core_file("pipeline_parallel", "schedules.py"), megatron_env.CORE_ID)
UTILS = megatron_env.peer_param(_core_file("utils.py"), megatron_env.CORE_ID)
FORWARD_BACKWARD = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                    "forward_backward_pipelining_with_interleaving")


def top_functions(path, names) -> dict:
    tree = ast.parse(path.read_text())
    found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names}
    assert set(found) == set(names), set(names) - set(found)
    return found


def small_pack(cp_size: int = 2):
    rng = np.random.default_rng(7)
    return build_thd_batch(rollouts(rng.integers(3, 30, 5), rank=0, seed=9), cp_size=cp_size)


@pytest.mark.parametrize("path", [SCHEDULES])
def test_forward_backward_kwargs_fit_megatron_signatures(path):
    functions = top_functions(path, FORWARD_BACKWARD)
    batches = [small_pack(), small_pack()]
    for vpp in (1, 2):
        kwargs = MegatronSteps(batches, pp_rank=1, pp_size=2, vpp_size=vpp).forward_backward_kwargs()
        if vpp > 1:
            assert isinstance(kwargs["data_iterator"], list) and len(kwargs["data_iterator"]) == vpp
        for name, fn in functions.items():
            a = fn.args
            assert not a.args and not a.posonlyargs and a.vararg is None and a.kwarg is None  # keyword-only
            params = [x.arg for x in a.kwonlyargs]
            required = {x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None}
            assert set(kwargs) <= set(params), (name, set(kwargs) - set(params))
            assert required <= set(kwargs) | {"forward_step_func", "model", "forward_only"}, (name, required)
    interleaved = ast.get_source_segment(path.read_text(), functions["forward_backward_pipelining_with_interleaving"])
    assert "data_iterator[model_chunk_id]" in interleaved
    # the interleaved function (and the others) take a list of iterators; the non-interleaved ones its first
    for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving"):
        assert "data_iterator = data_iterator[0]" in ast.get_source_segment(path.read_text(), functions[name])


@pytest.mark.parametrize("path", [UTILS])
def test_batch_keys_are_get_batch_on_this_tp_rank_s(path):
    fn = top_functions(path, ["get_batch_on_this_tp_rank"])["get_batch_on_this_tp_rank"]
    read = {n.slice.value for n in ast.walk(fn) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
            and n.value.id == "batch" and isinstance(n.slice, ast.Constant)}
    # local_cp_size is hybrid CP's (is_hybrid_cp), which a MegatronSteps batch is not
    assert set(BATCH_KEYS) == (read - {"local_cp_size"}) | {"packed_seq_params"}, read
    d = megatron_micro_batch(small_pack(), first_stage=True, last_stage=True)
    assert set(d) == set(BATCH_KEYS)


class _CPGroup:
    def __init__(self, size, rank):
        self.size, self.rank = size, rank


@functools.lru_cache(maxsize=None)
def megatron_cp_functions(path):
    """megatron-core's ``get_batch_on_this_cp_rank`` and its per-document helper, taken out of ``utils.py``
    with ``ast``: ``torch.distributed`` a stub reading a :class:`_CPGroup`, and TransformerEngine's
    ``tex.thd_get_partitioned_indices`` stood in for by ``thdpack.thd_partition_indices`` (tests/test_cp.py
    checks it against TE's kernel, emulated token by token)."""
    wanted = ["get_batch_on_this_cp_rank", "_get_batch_on_this_cp_rank_per_document_balancing"]
    nodes = list(top_functions(path, wanted).values())
    dist = types.SimpleNamespace(get_world_size=lambda g: g.size, get_rank=lambda g: g.rank, ProcessGroup=object)
    fake_torch = types.SimpleNamespace(distributed=dist, Tensor=torch.Tensor)
    tex = types.SimpleNamespace(thd_get_partitioned_indices=lambda cu, total, size, rank: _te_indices(cu, total,
                                                                                                       size, rank))
    namespace = {"torch": fake_torch, "tex": tex, "Dict": Dict, "Any": Any, "Optional": Optional,
                 "Callable": Callable}
    exec(compile(ast.Module(nodes, []), str(path), "exec"), namespace)
    return namespace["get_batch_on_this_cp_rank"], namespace


def _te_indices(cu, total, size, rank):
    assert cu.dim() == 1 and cu.dtype == torch.int32, cu  # TE takes the 1-D int32 offsets
    assert int(cu[-1]) == total, (cu, total)
    _te_indices.calls.append(cu.clone())
    return thdpack.thd_partition_indices(cu, size, rank)


_te_indices.calls = []


@pytest.mark.parametrize("path", [UTILS])
def test_get_batch_on_this_cp_rank_cuts_thdpacks_shards(path):
    get_batch_on_this_cp_rank, _ = megatron_cp_functions(path)
    batch = small_pack(cp_size=2)
    assert bool((batch.seq_lens % 4 != 0).any())  # some samples are padded: the padded offsets matter
    for r in range(2):
        shard = thdpack.shard(batch, cp_size=2, cp_rank=r)
        # a middle stage has nothing to cut: megatron-core 0.19.2's per-document function reads tokens or labels
        for first, last in ((True, False), (False, True)):
            d = megatron_micro_batch(batch, first_stage=first, last_stage=last)
            assert d["cu_seqlens_padded"].shape == (1, batch.num_samples + 1)
            _te_indices.calls.clear()
            out = get_batch_on_this_cp_rank(dict(d), is_hybrid_cp=False, cp_group=_CPGroup(2, r))
            assert len(_te_indices.calls) == 1
            assert torch.equal(_te_indices.calls[0], batch.cu_seqlens_padded.int())  # the padded key, row 0
            want = dict(tokens=shard.input_ids.long()[None], position_ids=shard.position_ids.long()[None],
                        labels=torch.where(shard.loss_mask, shard.labels, 0).long()[None],
                        loss_mask=shard.loss_mask.float()[None])
            for k in ("tokens", "position_ids") if first else ("labels", "loss_mask"):
                assert torch.equal(out[k], want[k]), (r, k)
            for k in ("labels", "loss_mask") if first else ("tokens", "position_ids"):
                assert out[k] is None
            for k in BOUNDARY_KEYS:  # metadata left as thdpack gave it
                assert out[k] is d[k]
            built = build_thd_batch(rollouts(np.random.default_rng(7).integers(3, 30, 5), rank=0, seed=9),
                                    cp_size=2, cp_rank=r)
            assert torch.equal(built.input_ids, shard.input_ids)


# --------------------------------------------------------------------------- 3. errors


def test_megatron_steps_errors():
    batches = [small_pack(), small_pack()]
    for p in (2, -1):
        with pytest.raises(ValueError, match=rf"pp_rank={p} is not a stage of pp_size=2"):
            MegatronSteps(batches, pp_rank=p, pp_size=2)
    with pytest.raises(ValueError, match="2 micro-batches given, but the step has num_micro_batches=3"):
        MegatronSteps(batches, pp_size=2, num_micro_batches=3)
    with pytest.raises(ValueError, match="got no micro-batches"):
        MegatronSteps([], pp_size=2)
    shard = thdpack.shard(batches[0], cp_size=2, cp_rank=1)
    steps = MegatronSteps([shard], pp_size=2)  # refused where a batch is read
    with pytest.raises(ValueError, match="CP rank 1's shard of a pack.*give the whole pack"):
        next(steps.iterator(0))
    with pytest.raises(TypeError, match="micro-batch 1 is a dict, not a thdpack.ThdBatch"):
        MegatronSteps([batches[0], {"input_ids": [1, 2]}])
    with pytest.raises(ValueError, match="pp_size"):
        MegatronSteps(batches, pp_size=0)


# --------------------------------------------------------------------------- 4. the checks catch breakage


def test_checks_catch_a_reversed_rank_order(gloo_results):
    plan, offsets = offline_plan("vpp")
    outputs = [dict(r["vpp"]) for r in gloo_results]
    outputs[1]["sample_index"] = outputs[1]["sample_index"][::-1]
    with pytest.raises(AssertionError):
        check_against_plan("vpp", outputs, plan, offsets)


def test_checks_catch_middle_stages_without_boundaries(monkeypatch):
    batches = [small_pack(), small_pack(cp_size=1)]
    real = megatron_micro_batch

    def broken(batch, *, first_stage, last_stage, **kw):
        d = real(batch, first_stage=first_stage, last_stage=last_stage, **kw)
        return d if first_stage or last_stage else {**d, "cu_seqlens": None}

    check_stage_records(stage_records(batches, 4, 2, 2), batches, 4, 2)  # as it is: passes
    monkeypatch.setattr(megatron_steps, "megatron_micro_batch", broken)
    with pytest.raises(AssertionError):
        check_stage_records(stage_records(batches, 4, 2, 2), batches, 4, 2)
