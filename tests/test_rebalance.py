"""thdpack.rebalance: run-time rebalancing of samples across data-parallel ranks.

* Real ``gloo`` groups of 2 and 4 processes (one fork per world size, every scenario inside the
  workers, results written to files and checked here): every sample is scored exactly once
  (global sample ids), each micro-batch equals ``build_thd_batch`` of its samples as they were made
  on their ranks (tokens, labels, positions, a per-sample field), ``restore`` gives back each
  rank's order (tensors, 2-D tensors without the fillers' rows, lists), groups stay on one rank and
  in one pack (or one step's bundle), a rank with no samples still gets work, the per-rank cost
  straggler is <= 1.02 with one rank holding all the long samples, the CP layout composes (aligned
  whole packs, and ``cp_rank`` shards equal to ``thdpack.shard`` of them), errors are raised on
  every rank alike (no hang), and a tiny random float64 Qwen3 run on the rebalanced packs gives,
  through ``sequence_logps`` and ``restore``, each sample's log-probability computed alone on the
  rank that made it.
* Hypothesis over ranks (run as threads over a transport that does what ``all_to_all_single``
  does), sample counts (empty ranks too), lengths, groups and micro-batches: the same checks.
* One process without ``torch.distributed``: world size 1; argument errors; the sample codec.

Workers are forked (``start_method="fork"``, as tests/test_flops.py does): they inherit the imported
modules and the model instead of importing them again.
"""

from __future__ import annotations

import functools
import threading
import zlib
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import thdpack  # noqa: E402
from thdpack import CostModel, build_thd_batch, plan_packs, rebalance  # noqa: E402
from thdpack.demo.models import TINY_TEXT  # noqa: E402
from thdpack.loaders.exchange import Comm, decode_sample, encode_sample  # noqa: E402
from thdpack.flops import seqlen_squared_sum  # noqa: E402
from thdpack.losses import sequence_logps  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402

IGNORE = -100
VOCAB = 64
COST = CostModel(1.0, 1.0 / 256)  # tokens plus attention's Σ s²: the long samples weigh more than their tokens
FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded", "seq_lens")


def rollouts(lengths, *, rank: int, seed: int) -> list[dict]:
    """Samples of ``rank``: random tokens, the first 2 labels masked, a ``uid`` (rank·1000 + i)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    out = []
    for i, s in enumerate(lengths):
        ids = torch.randint(1, VOCAB, (int(s),), generator=g)
        labels = ids.clone()
        labels[:2] = IGNORE
        out.append({"input_ids": ids, "labels": labels, "uid": rank * 1000 + i, "note": f"rank {rank} row {i}"})
    return out


def grpo_rollouts(prompts, completions, *, rank: int, seed: int) -> list[dict]:
    """GRPO groups of ``rank``: group ``g`` (its ``"group"`` field, the same ids on every rank) is
    ``len(completions[g])`` rollouts of one random prompt of ``prompts[g]`` tokens (labels masked) and a
    random completion each; a ``uid`` (rank·1000 + i)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    out = []
    for gid, (p, cs) in enumerate(zip(prompts, completions)):
        prompt = torch.randint(1, VOCAB, (int(p),), generator=g)
        for c in cs:
            ids = torch.cat([prompt, torch.randint(1, VOCAB, (int(c),), generator=g)])
            labels = ids.clone()
            labels[: int(p)] = IGNORE
            out.append({"input_ids": ids, "labels": labels, "group": gid, "uid": rank * 1000 + len(out)})
    return out


SHARE = dict(share_prefix="group", min_prefix_len=4)


def scenario(name: str, rank: int, world: int) -> tuple[list[dict], dict]:
    """``(local samples, rebalance keywords)`` of a scenario on ``rank``: the workers and the checks
    here make the same ones."""
    key = "cp" if name == "cp_shard" else name  # the same samples, whole packs or shards
    rng = np.random.default_rng([zlib.crc32(key.encode()), rank, world])
    if name == "skewed":  # rank 0 made every long rollout
        n = 60
        lengths = rng.integers(150, 500, n) if rank == 0 else rng.integers(5, 60, n)
        return rollouts(lengths, rank=rank, seed=1), dict(pack_size=512, micro_batches=2, cost=COST)
    if name == "grouped":  # 6 prompts x 4 rollouts per rank, the same prompt ids on every rank
        lengths = rng.integers(30, 120, 24) if rank == 0 else rng.integers(5, 40, 24)
        groups = np.repeat(np.arange(6), 4)
        return rollouts(lengths, rank=rank, seed=2), dict(pack_size=256, micro_batches=2, groups=groups, cost=COST)
    if name == "empty":  # only rank 0 made rollouts
        lengths = rng.integers(10, 100, 24) if rank == 0 else []
        return rollouts(lengths, rank=rank, seed=3), dict(pack_size=128)
    if name in ("cp", "cp_shard"):
        layout = dict(cp_size=2) if name == "cp" else dict(cp_size=2, cp_rank=1)
        return rollouts(rng.integers(5, 50, 12), rank=rank, seed=4), dict(pack_size=128, **layout)
    if name == "model":
        return rollouts(rng.integers(3, 40, 6), rank=rank, seed=5), dict(pack_size=64)
    if name == "shared":  # 60 prompts x 4 rollouts per rank, rank 0's long; each group fits one pack shared
        long = rank == 0
        prompts = rng.integers(50, 130, 60) if long else rng.integers(10, 40, 60)
        completions = rng.integers(20, 90, (60, 4)) if long else rng.integers(5, 30, (60, 4))
        return grpo_rollouts(prompts, completions, rank=rank, seed=6), dict(pack_size=512, micro_batches=2,
                                                                             cost=COST, **SHARE)
    if name == "shared_model":  # 2 prompts x 3 rollouts per rank; the second prompt too short to share
        samples = grpo_rollouts([rng.integers(6, 14), 2], rng.integers(1, 8, (2, 3)), rank=rank, seed=7)
        return samples, dict(pack_size=64, **SHARE)
    raise KeyError(name)


EXCHANGES = ("skewed", "grouped", "empty", "cp", "cp_shard", "shared")
TREE_FIELDS = ("parents", "first_rows", "first_labels", "unshared_rows")


def run_rank(samples: list[dict], kwargs: dict, group=None) -> dict:
    """One rank's rebalance, and three restores of values derived from the samples' ``uid``."""
    batches, handle = rebalance(samples, group=group, sample_values=["uid"], **kwargs)
    uid = torch.cat([b.sample_values["uid"] for b in batches]) if batches else torch.zeros(0, dtype=torch.int64)
    real = torch.cat([b.sample_values["uid"] for b, f in zip(batches, handle.filler) if not f] or [uid[:0]])
    return dict(
        batches=batches, filler=handle.filler.tolist(), offsets=handle.offsets.tolist(), straggler=handle.straggler,
        back=handle.restore(uid.to(torch.float64) * 2 + 1),  # fillers' rows included
        back_2d=handle.restore(torch.stack([real, -real], 1).to(torch.int32)),  # without them
        back_list=handle.restore([f"u{u}" for u in uid.tolist()]),
    )


def check_exchange(name: str, world: int, outputs: list[dict]) -> None:
    """Every check of one scenario over the ranks' ``outputs`` (each from :func:`run_rank`)."""
    inputs = [scenario(name, r, world) for r in range(world)]
    samples = [s for local, _ in inputs for s in local]
    kwargs = inputs[0][1]
    layout = {k: kwargs[k] for k in ("cp_size", "cp_rank", *SHARE) if k in kwargs}
    if "share_prefix" in kwargs:  # a group is (rank, its id): two ranks' group 3 are two groups
        samples = [{**s, "group": r * 1000 + s["group"]} for r, (local, _) in enumerate(inputs) for s in local]
    counts = [len(local) for local, _ in inputs]
    assert all(o["offsets"] == np.concatenate([[0], np.cumsum(counts)]).tolist() for o in outputs)
    assert len({len(o["batches"]) for o in outputs}) == 1  # every rank runs as many micro-batches
    scored = []
    for o in outputs:
        for batch, filler in zip(o["batches"], o["filler"]):
            ids = batch.sample_index.tolist()
            alone = build_thd_batch([samples[g] for g in ids], sample_index=ids, sample_values=["uid"], **layout)
            names = FIELDS + (("shard.partition_indices",) if "cp_rank" in layout else ())
            for field in names if not filler else ("input_ids", "position_ids"):
                assert torch.equal(attrgetter(field)(batch), attrgetter(field)(alone)), (name, field)
            assert (batch.prefix_tree is None) == (alone.prefix_tree is None), name
            for field in TREE_FIELDS if alone.prefix_tree is not None else ():
                assert torch.equal(getattr(batch.prefix_tree, field), getattr(alone.prefix_tree, field)), field
            assert torch.equal(batch.sample_values["uid"], torch.tensor([samples[g]["uid"] for g in ids]))
            if filler:
                assert batch.num_targets == 0 and len(ids) == 1
            else:
                scored += ids
    assert sorted(scored) == list(range(len(samples)))  # every sample scored exactly once
    for (local, _), o in zip(inputs, outputs):
        uid = [s["uid"] for s in local]
        assert o["back"].dtype == torch.float64 and o["back"].tolist() == [2.0 * u + 1 for u in uid]
        assert o["back_2d"].dtype == torch.int32 and o["back_2d"].tolist() == [[u, -u] for u in uid]
        assert o["back_list"] == [f"u{u}" for u in uid]
    if "groups" in kwargs or "share_prefix" in kwargs:
        check_groups(inputs, outputs, kwargs["pack_size"], kwargs["micro_batches"])
    if "share_prefix" in kwargs:  # the prefixes were shared: each group's prompt once
        trees = [b for o in outputs for b, f in zip(o["batches"], o["filler"]) if not f and b.prefix_tree is not None]
        alone = sum(int(samples[g]["input_ids"].numel()) for b in trees for g in b.sample_index.tolist())
        assert trees and sum(int(b.seq_lens.sum()) for b in trees) < alone


def check_groups(inputs, outputs, pack_size: int, micro_batches: int) -> None:
    """Each (rank, prompt id) group runs on one rank: in one pack when it fits one (every shared-prefix
    group does here), else in at most ``micro_batches`` packs of one step."""
    key = [(r, int(g)) for r, (local, kw) in enumerate(inputs)
           for g in (kw["groups"] if "groups" in kw else [s["group"] for s in local])]
    tokens = [0 if "share_prefix" in kw else int(s["input_ids"].numel()) for local, kw in inputs for s in local]
    where = {}
    for r, o in enumerate(outputs):
        for k, (batch, filler) in enumerate(zip(o["batches"], o["filler"])):
            for g in ([] if filler else batch.sample_index.tolist()):
                where.setdefault(key[g], set()).add((r, k))
    assert len(where) == len(set(key))
    for group, places in where.items():
        size = sum(t for t, kk in zip(tokens, key) if kk == group)
        assert len({r for r, _ in places}) == 1, group
        assert len({k // micro_batches for _, k in places}) == 1, group
        assert len(places) == 1 if size <= pack_size else len(places) <= micro_batches, (group, size, places)


def rank_cost(batches) -> float:
    """The batches' cost under COST: tokens of the stream (a tree's prefixes once) and ``Σ s²`` (a tree's
    attention work, ``p² + Σ c·(2p + c)``)."""
    return sum(COST.linear * int(b.seq_lens.sum()) + COST.quadratic * seqlen_squared_sum(b) for b in batches)


# --------------------------------------------------------------------------- real gloo groups


@functools.lru_cache(maxsize=None)
def tiny_model() -> torch.nn.Module:
    """A 2-layer random Qwen3 in float64 (initializer 0.2: O(1) logits), sdpa."""
    config = transformers.Qwen3Config(vocab_size=VOCAB, **TINY_TEXT, max_position_embeddings=256,
                                      initializer_range=0.2, attn_implementation="sdpa")
    torch.manual_seed(3)
    return transformers.Qwen3ForCausalLM(config).to(torch.float64).eval()


def alone_logp(model, sample) -> torch.Tensor:
    """Sum of the sample's target log-probs, run alone (batch axis 1, no thdpack)."""
    logits = model(input_ids=sample["input_ids"][None], use_cache=False).logits[0, :-1]
    targets = sample["labels"][1:]
    keep = targets != IGNORE
    return torch.log_softmax(logits, -1)[keep].gather(1, targets[keep][:, None]).sum()


@torch.no_grad()
def model_scenario(rank: int, world: int, model, name: str = "model") -> dict:
    """``name``'s samples alone and through rebalance -> the model -> sequence_logps -> restore (sdpa: a
    shared-prefix pack gets its dense tree mask)."""
    samples, kwargs = scenario(name, rank, world)
    alone = torch.stack([alone_logp(model, s) for s in samples])
    batches, handle = rebalance(samples, **kwargs)
    logps = [sequence_logps(model(**to_hf_kwargs(b, include_labels=False, attn_implementation="sdpa"),
                                  use_cache=False).logits, b)[0] for b in batches]
    trees = [b.prefix_tree is not None for b, f in zip(batches, handle.filler) if not f]
    return dict(alone=alone, back=handle.restore(torch.cat(logps)), trees=trees)


def error_scenarios(rank: int, world: int) -> list[str]:
    """Messages each rank raises for a bad input on the last rank only (every rank must raise)."""
    messages, last = [], world - 1
    samples, _ = scenario("empty", 0, world)
    bad_cases = [
        (samples[:4] if rank == last else [], dict(pack_size=int(max(len(s["input_ids"]) for s in samples[:4])) - 1)),
        (samples[:4], dict(pack_size=128, groups=[0, 0, 1] if rank == last else [0, 0, 1, 1])),
        ([{**s, "group": 0, "prefix_len": 5 if rank == last else 0} for s in samples[:2]], dict(pack_size=128, **SHARE)),
    ]  # the last: rank `last` declares a prompt its two rollouts do not share
    for local, kwargs in bad_cases:
        try:
            rebalance(local, **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def _worker(rank: int, world: int, init_file: str, out_dir: str, model) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {"errors": error_scenarios(rank, world)}  # first: the group must still work after them
        for name in EXCHANGES:
            results[name] = run_rank(*scenario(name, rank, world))
        results["model"] = model_scenario(rank, world, model)
        results["shared_model"] = model_scenario(rank, world, model, "shared_model")
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def warm_up() -> None:
    """The model's first forward and the planner's compiled kernels, once here rather than in every fork."""
    model_scenario(0, 1, tiny_model())
    run_rank(*scenario("grouped", 0, 1))


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def gloo_results(request, tmp_path_factory):
    import torch.multiprocessing as mp

    world, tmp = request.param, tmp_path_factory.mktemp(f"rebalance{request.param}")
    warm_up()
    mp.start_processes(_worker, args=(world, str(tmp / "init"), str(tmp), tiny_model()), nprocs=world, join=True,
                       start_method="fork")
    return world, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("name", EXCHANGES)
def test_exchange_over_gloo(gloo_results, name):
    world, results = gloo_results
    check_exchange(name, world, [r[name] for r in results])


@pytest.mark.parametrize("name", ["skewed", "shared"])
def test_skewed_ranks_are_balanced(gloo_results, name):
    """Rank 0 made every long rollout: alone it would cost ~2-3.5x the mean; rebalanced <= 1.02 (with
    shared prefixes: the cost of the trees, each prompt once, which the handle's straggler counts)."""
    world, results = gloo_results
    costs = np.array([rank_cost(r[name]["batches"]) for r in results])
    assert costs.max() / costs.mean() <= 1.02
    assert results[0][name]["straggler"] == pytest.approx(costs.max() / costs.mean())
    share = {k: v for k, v in scenario(name, 0, world)[1].items() if k in SHARE}
    before = np.array([rank_cost([build_thd_batch(scenario(name, r, world)[0], **share)]) for r in range(world)])
    assert before.max() / before.mean() > 1.6  # the input really is skewed


def test_empty_ranks_get_work(gloo_results):
    world, results = gloo_results
    for r in results:
        assert not all(r["empty"]["filler"]) and len(r["empty"]["batches"]) >= 1


def test_cp_layout_composes(gloo_results):
    """``cp_size=2``: whole packs aligned to 2·cp; with ``cp_rank`` the same packs' ``thdpack.shard`` shards."""
    world, results = gloo_results
    for r in results:
        for whole, shard in zip(r["cp"]["batches"], r["cp_shard"]["batches"], strict=True):
            assert (whole.cu_seqlens_padded % 4 == 0).all() and whole.pad_multiple == 4
            want = thdpack.shard(whole, cp_size=2, cp_rank=1)
            for field in ("input_ids", "labels", "position_ids", "shard.partition_indices", "shard.local_cu_seqlens_padded"):
                assert torch.equal(attrgetter(field)(shard), attrgetter(field)(want)), field


def test_model_logps_come_back_to_their_rank(gloo_results):
    """A tiny float64 Qwen3 on the rebalanced packs: sequence_logps restored = each sample alone."""
    _, results = gloo_results
    for r in results:
        torch.testing.assert_close(r["model"]["back"], r["model"]["alone"], rtol=0, atol=1e-9)


def test_shared_prefix_model_logps_come_back_to_their_rank(gloo_results):
    """Shared-prefix packs (each rank's first prompt once, its 3 rollouts after it; the second prompt
    too short to share): per-member sequence_logps restored = each rollout alone on its rank."""
    _, results = gloo_results
    assert any(t for r in results for t in r["shared_model"]["trees"])  # a rank may get only unshared packs
    for r in results:
        torch.testing.assert_close(r["shared_model"]["back"], r["shared_model"]["alone"], rtol=0, atol=1e-9)


def test_errors_are_raised_on_every_rank(gloo_results):
    world, results = gloo_results
    last = world - 1
    for r in results:
        too_long, groups, prefix = r["errors"]
        assert r["errors"] == results[0]["errors"]
        assert prefix.startswith(f"rebalance: rank {last}: group 0 (samples 0, 1): sample 1's token 0 differs from "
                                 "sample 0's within the declared prefix_len=5")
        assert f"rebalance: sample 0 of rank {last} has" in too_long or f"of rank {last} has" in too_long
        assert groups.startswith(f"rebalance: rank {last}: groups must hold one integer group id per local sample (4)")


# --------------------------------------------------------------------------- ranks as threads


@dataclass(frozen=True)
class ThreadComm(Comm):
    """A rank of a group whose ranks are threads of this process: ``all_to_all`` does what
    ``all_to_all_single`` does (rank ``d`` gets, from every rank ``s`` in order, the ``in_splits[d]``
    rows ``s`` put at its offset ``sum(in_splits[:d])``)."""

    hub: object = None

    def _round(self, item):
        hub = self.hub
        hub.slots[self.rank] = item
        hub.barrier.wait()
        seen = list(hub.slots)
        hub.barrier.wait()
        return seen

    def all_gather_object(self, record):
        return self._round(record)

    def all_to_all(self, send, in_splits, out_splits):
        seen = self._round((send, list(in_splits)))
        parts = []
        for s, (data, splits) in enumerate(seen):
            start = sum(splits[: self.rank])
            parts.append(data[start : start + splits[self.rank]])
            assert parts[-1].shape[0] == out_splits[s], "receive sizes disagree with what was sent"
        return torch.cat(parts) if parts else send[:0]


def run_threads(world: int, work) -> list:
    """``work(comm)`` on ``world`` threads, each a rank; returns each rank's result or exception."""
    hub = type("Hub", (), {})()
    hub.slots, hub.barrier = [None] * world, threading.Barrier(world, timeout=20)  # a rank left alone: broken
    out = [None] * world

    def one(rank):
        try:
            out[rank] = work(ThreadComm(None, rank, world, torch.device("cpu"), hub))
        except Exception as exc:  # noqa: BLE001 - compared across ranks below
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@st.composite
def thread_cases(draw):
    world = draw(st.integers(1, 4))
    pack_size = draw(st.sampled_from([16, 40, 64]))
    micro_batches = draw(st.integers(1, 3))
    counts = draw(st.lists(st.integers(0, 9), min_size=world, max_size=world))
    mode = draw(st.sampled_from(["plain", "groups", "share"]))
    top = pack_size // 4 if mode == "share" else pack_size  # share: completions, after a prompt (with_prompts)
    lengths = [draw(st.lists(st.integers(1, top), min_size=n, max_size=n)) for n in counts]
    groups = None
    if mode != "plain":
        groups = [draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) for n in counts]
    cp = draw(st.sampled_from([{}, {"cp_size": 2}]))
    if mode == "share":  # shared prefixes (no CP with them)
        cp = {**SHARE, "pad_multiple": draw(st.sampled_from([1, 4]))}
    return world, pack_size, micro_batches, lengths, groups, cp


def with_prompts(samples: list[dict], groups: list[int], rank: int, pack_size: int) -> list[dict]:
    """``samples`` (the completions) after their group ``g``'s prompt of ``8 + 4·g`` tokens, cut to
    ``pack_size`` in all."""
    out = []
    for s, g in zip(samples, groups):
        prompt = torch.randint(1, VOCAB, (8 + 4 * g,), generator=torch.Generator().manual_seed(rank * 10 + g))
        ids = torch.cat([prompt, s["input_ids"]])
        ids = ids[:pack_size]
        labels = ids.clone()
        labels[:2] = IGNORE
        out.append({**s, "input_ids": ids, "labels": labels, "group": g})
    return out


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(thread_cases())
def test_restore_permutation_over_thread_ranks(case):
    """Any ranks, counts (empty ranks too), lengths, groups, micro-batches: every sample scored once,
    the packs equal their samples built alone, restore returns every rank's own order; or, when the
    plan refuses the input (a sample or group too large), every rank raises the same error."""
    world, pack_size, micro_batches, lengths, groups, cp = case
    inputs = [rollouts(lengths[r], rank=r, seed=9) for r in range(world)]
    if "share_prefix" in cp:
        inputs = [with_prompts(inputs[r], groups[r], r, pack_size) for r in range(world)]
    kw = [dict(pack_size=pack_size, micro_batches=micro_batches, **cp,
               **({} if groups is None else {"groups": groups[r]})) for r in range(world)]
    outputs = run_threads(world, lambda comm: run_rank(inputs[comm.rank], kw[comm.rank], group=comm))
    errors = [o for o in outputs if isinstance(o, BaseException)]
    event("refused" if errors else "planned")
    if errors:
        assert all(isinstance(o, ValueError) for o in outputs), outputs
        assert len({str(o) for o in outputs}) == 1
        return
    samples = [s for local in inputs for s in local]
    scored = sorted(g for o in outputs for b, f in zip(o["batches"], o["filler"]) if not f
                    for g in b.sample_index.tolist())
    assert scored == list(range(len(samples)))
    for o in outputs:
        for b in o["batches"]:
            ids = b.sample_index.tolist()
            if b.prefix_tree is None:
                assert torch.equal(b.input_ids, build_thd_batch([samples[g] for g in ids], **cp).input_ids)
                continue  # a tree: every member's tokens read back through its rows, the pack within budget
            event("shared")
            assert int(b.cu_seqlens_padded[-1]) <= pack_size
            own = torch.cat([torch.as_tensor(samples[g]["input_ids"]) for g in ids])
            assert torch.equal(b.input_ids[b.prefix_tree.unshared_rows], own)
    for local, o in zip(inputs, outputs):
        assert o["back"].tolist() == [2.0 * s["uid"] + 1 for s in local]
        assert o["back_list"] == [f"u{s['uid']}" for s in local]


# --------------------------------------------------------------------------- one process


def test_one_process_without_distributed():
    """No process group: world size 1, packs planned here, restore a permutation back."""
    samples, _ = scenario("skewed", 0, 1)
    batches, handle = rebalance(samples, 1024, micro_batches=2, cost=COST)
    assert handle.world_size == 1 and handle.rank == 0 and len(batches) % 2 == 0
    ids = handle.sample_ids
    assert sorted(ids.tolist()) == list(range(len(samples))) and ids.tolist() != sorted(ids.tolist())
    assert all(b.num_tokens <= 1024 for b in batches)
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    assert torch.equal(handle.restore(torch.cat([b.seq_lens for b in batches]).long()), lengths)
    assert len(batches) == len(plan_packs(lengths.numpy(), 1024)) + (len(plan_packs(lengths.numpy(), 1024)) % 2)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        rebalance(samples, 1024, group=object())


def test_filler_micro_batches_score_nothing():
    """One sample, two micro-batches per rank: the second is a filler with no targets; restore takes
    values with or without its row."""
    samples, _ = scenario("model", 0, 1)
    batches, handle = rebalance(samples[:1], 64, micro_batches=2)
    assert handle.filler.tolist() == [False, True] and [b.num_targets for b in batches][1] == 0
    assert batches[0].num_targets == len(samples[0]["input_ids"]) - 2  # labels 0, 1 masked: targets 2..
    assert handle.restore(torch.tensor([5.0, 7.0])).tolist() == [5.0] == handle.restore(torch.tensor([5.0])).tolist()
    with pytest.raises(ValueError, match=r"restore got 3 values on rank 0; expected one per sample of its batches, "
                                         r"2 \(or 1 without the 1 filler micro-batches\)"):
        handle.restore([1, 2, 3])
    with pytest.raises(TypeError, match="restore takes a tensor, numpy array or list"):
        handle.restore("ab")
    assert handle.restore(np.array([1, 2])).tolist() == [1]


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((0,), {}, ValueError, "pack_size must be an integer >= 1"),
    ((64,), {"micro_batches": 0}, ValueError, "micro_batches must be an integer >= 1"),
    ((64,), {"cost": "tokens"}, TypeError, "cost must be a CostModel"),
    ((64,), {"pad_multple": 8}, TypeError, r"unexpected keyword argument\(s\) 'pad_multple'"),
    ((64,), {"pad_to": 32}, ValueError, "pad_to=32 is shorter than pack_size=64"),
    ((2,), {"cp_size": 2}, ValueError, "pack_size=2 is smaller than the layout's pad multiple 4"),
    ((8,), {}, ValueError, r"rebalance: sample 1 of rank 0 has 9 tokens \(9 aligned to 1\), more than pack_size=8"),
    ((10,), {"cp_size": 2}, ValueError, r"sample 1 of rank 0 has 9 tokens \(12 aligned to 4\)"),
    ((64,), {"groups": [0, 1]}, ValueError, r"rank 0: groups must hold one integer group id per local sample \(3\)"),
    ((64,), {"groups": [0.5, 1, 2]}, ValueError, "got shape \\(3,\\) and dtype float64"),
    ((16,), {"groups": [7, 7, 7]}, ValueError, r"group 7 of rank 0 has 20 tokens \(aligned\), more than "
                                                r"micro_batches=1 packs hold \(16\)"),
])
def test_argument_errors(args, kwargs, error, match):
    samples = rollouts([6, 9, 5], rank=0, seed=0)
    with pytest.raises(error, match=match):
        rebalance(samples, *args, **kwargs)


def test_shared_prefix_one_process():
    """A group that fits a pack only shared (3 x (40 + 5) tokens: 135 unshared, 55 shared, pack 64) is
    accepted and laid out as one tree; restore maps its members back; the handle counts the prompt once."""
    samples = grpo_rollouts([40], [[5, 5, 5]], rank=0, seed=0)
    batches, handle = rebalance(samples, 64, sample_values=["uid"], **SHARE)
    assert len(batches) == 1 and batches[0].num_tokens == 55 and batches[0].prefix_tree is not None
    assert handle.rank_costs.tolist() == [55.0] and batches[0].seq_lens.tolist() == [40, 5, 5, 5]
    assert handle.restore(batches[0].sample_values["uid"]).tolist() == [s["uid"] for s in samples]
    assert rebalance(samples, 64, groups=[7, 7, 7], **SHARE)[0][0].num_tokens == 55  # groups= alike: the same
    with pytest.raises(ValueError, match=r"group 0 of rank 0 has 135 tokens \(aligned\), more than micro_batches=1"):
        rebalance(samples, 64, groups=[0, 0, 0])  # unshared, the group needs three packs


@pytest.mark.parametrize("kwargs, samples, match", [
    (dict(groups=[0, 1, 1]), None, r"rank 0: groups= and the share_prefix field 'group' group the samples differently "
                                   r"\(local sample 1: groups 1, group 0\)"),
    (dict(cp_size=2), None, r"share_prefix='group' with cp_size=2: context-parallel attention"),
    (dict(min_prefix_len=0), None, r"min_prefix_len must be an integer >= 1"),
    ({}, [{"input_ids": [1, 2, 3]}], r"rank 0: sample 0.*'group'"),
    ({}, [{"input_ids": [1, 2, 3], "group": 0, "prefix_len": 4}] * 2, r"rank 0: group 0 \(samples 0, 1\) declares "
                                                                       r"prefix_len=4, but sample 0 has 3 tokens"),
])
def test_shared_prefix_errors(kwargs, samples, match):
    samples = samples or grpo_rollouts([40], [[5, 5, 5]], rank=0, seed=0)
    with pytest.raises(ValueError, match=match) as info:
        rebalance(samples, 64, **{**SHARE, **kwargs})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("samples, match", [
    (None, "rank 0: rebalance takes a list of samples"),
    ([{"input_ids": [1, 2]}, [1, 2]], "rank 0: sample 1 is a list"),
    ([{"input_ids": []}], "rank 0: sample 0: 'input_ids' is empty"),
    ([{"input_ids": [1.5, 2]}], "rank 0: sample 0: field 'input_ids'"),
])
def test_sample_errors_name_the_rank(samples, match):
    with pytest.raises(ValueError, match=match):
        rebalance(samples, 64)


def test_sample_codec_keeps_every_field():
    pixels = torch.randn(3, 4).to(torch.bfloat16)
    sample = {"input_ids": torch.arange(5), "labels": [1, 2, -100], "pixel_values": pixels, "reward": 0.25,
              "text": "why", "mask": torch.tensor([True, False]), "grid": np.array([[1, 2, 2]])}
    back = decode_sample(memoryview(encode_sample(sample)))
    assert back.keys() == sample.keys() and back["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(back["pixel_values"], pixels) and torch.equal(back["input_ids"], sample["input_ids"])
    assert torch.equal(back["mask"], sample["mask"]) and (back["grid"] == sample["grid"]).all()
    assert (back["labels"], back["reward"], back["text"]) == ([1, 2, -100], 0.25, "why")
