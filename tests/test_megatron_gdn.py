"""megatron-core's Gated DeltaNet (GDN) on a thdpack pack gets every field it reads (issue 29 §6).

What megatron-core 0.19.2's GDN reads of ``PackedSeqParams`` (``megatron/core/ssm/gated_delta_net/gdn.py``,
``GatedDeltaNet.forward``; 0.18's ``megatron/core/ssm/gated_delta_net.py`` reads the same fields), when
``qkv_format == "thd"``:

- ``cu_seqlens_q_padded``, else (None) ``cu_seqlens_q``, and ``cu_seqlens_kv_padded`` / ``cu_seqlens_kv`` likewise
  (``_GDNBase._resolve_cu_seqlens``): the stream layout. It refuses a layout whose last offset is not the global
  stream length (``hidden_states`` rows x sp x cp) or whose sequence lengths are not multiples of cp, and q's
  layout that differs from kv's. The one resolved tensor goes, unchanged, to the short convolution
  (fla's ``causal_conv1d(cu_seqlens=...)``) and to the scan (fla's ``chunk_gated_delta_rule(cu_seqlens=...)``):
  both run over the *padded* spans, pad slots after each sample's tokens (causal: they never reach them).
- with CP (cp > 1), the same global offsets build ``_build_thd_cp_a2a_perm``: after the all-to-all that gathers
  the ranks' shards (in rank order), it reorders the stream from the ranks' dual-chunk (load-balanced) layout to
  the natural one, per sequence; ``local`` offsets are never read.
- not read by GDN: ``max_seqlen_q/kv``, ``total_tokens`` and ``seq_idx`` (the Mamba mixer of a hybrid model reads
  ``seq_idx``, which ``PackedSeqParams.__post_init__`` builds from ``total_tokens``: checked here too),
  ``local_cp_size``, ``cp_group``. GDN asserts batch 1 and refuses ``deterministic_mode`` with packing.

How it is checked. As shipped, megatron-core's GDN cannot run on CPU: its constructor raises ``ImportError``
without flash-linear-attention (``HAVE_FLA``), puts its parameters on ``torch.cuda.current_device()``, and its
forward calls fla's Triton kernels. So, in a subprocess where megatron-core 0.19.2's wheel is importable
(tests/megatron_env.py, whose ``run`` starts this file as its runner), its own ``GatedDeltaNet`` is built and
run with only these replaced: ``HAVE_FLA``, ``torch.cuda.current_device`` (-> CPU), and fla's three kernels,
by CPU stand-ins that record the ``cu_seqlens`` megatron hands them (the scan stand-in is megatron-core's own
``torch_chunk_gated_delta_rule``, its deterministic path, run on each span; the convolution a depthwise
``F.conv1d`` on each span; l2norm fla's formula). Its submodules are given as a spec allows: the in/out
projections plain ``torch.nn.Linear`` (megatron's are tensor-parallel wrappers of the same product), the norm
megatron-core's ``WrappedTorchNorm`` (benchmarks/gpu_megatron_gdn.py ``gdn_layer``, shared with the GPU check).
Everything else (``_resolve_cu_seqlens``, the CP all-to-alls and permutation, the split, gating, norm) is
megatron-core's code. The test asserts that

1. what the convolution and the scan receive is the samples' spans, ``cu_seqlens_padded`` (with
   ``max_num_seqs``, padded with zero-length sequences), with and without alignment padding, ``pad_to``,
   static shapes;
2. ``seq_idx`` that megatron-core's ``PackedSeqParams`` builds equals ``seq_idx(batch)``, and ``total_tokens`` is
   the stream;
3. the layer's output on the pack equals its output on each sample alone (float32, CPU);
4. with CP (2 and 4 ranks, with and without ``pad_multiple``), every rank's shard passes
   ``_resolve_cu_seqlens`` at its local length x cp, and ``_build_thd_cp_a2a_perm`` of its offsets turns the
   ranks' thdpack shards, concatenated in rank order, back into the stream;
5. megatron-core's GDN with CP 2 (two gloo processes, its own all-to-all), each rank fed thdpack's shard and
   ``to_packed_seq_params(shard)``, gives each rank the output rows of the whole pack run at cp 1.

benchmarks/gpu_megatron_gdn.py runs the same layer with fla's real kernels on a GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import megatron_env  # tests/megatron_env.py

import thdpack
from thdpack import build_thd_batch
from thdpack.attention.static import pad_cu_seqlens
from thdpack.integrations import to_packed_seq_params
from thdpack.batching import seq_idx

pytestmark = pytest.mark.xdist_group("megatron_gdn")  # one worker, one subprocess for all (--dist loadgroup)
ROOT = Path(__file__).resolve().parent.parent
SAMPLES = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [23], [24, 25, 26, 27, 28, 29]]
LAYOUTS = {  # 5 samples, 25 tokens
    "unpadded": {},
    "pad_multiple": {"pad_multiple": 8},
    "pad_to": {"pad_to": 32},
    "static_unpadded": {"max_num_seqs": 7},
    "static_pad_multiple_pad_to": {"pad_multiple": 4, "max_num_seqs": 8, "pad_to": 48},
}
CP_LAYOUTS = {"cp2": {"cp_size": 2}, "cp2_pad_multiple": {"cp_size": 2, "pad_multiple": 8}, "cp4": {"cp_size": 4}}


def _answer(answers: dict, kind: str, name: str) -> dict:
    got = answers[kind, name]
    if "error" in got:
        pytest.fail(f"megatron-core's code raised on thdpack's {name} batch:\n{got['error'][-3000:]}")
    return got


def _batch(layout: dict):
    return build_thd_batch([{"input_ids": s} for s in SAMPLES], **layout)


@pytest.fixture(scope="module")
def answers():
    """Every task run once, in one subprocess with megatron-core 0.19.2 (this file as the runner)."""
    site = megatron_env.bridge_site()
    if isinstance(site, str):
        pytest.skip(f"megatron-core 0.19.2 is not available here ({site}): its GDN code is what is checked")
    tasks = [{"kind": "forward", "name": name, "layout": layout} for name, layout in LAYOUTS.items()]
    tasks += [{"kind": "cp_perm", "name": name, "layout": layout} for name, layout in CP_LAYOUTS.items()]
    tasks += [{"kind": "cp_forward", "name": "cp2", "layout": {"cp_size": 2, "pad_multiple": 4}}]
    mp = pytest.MonkeyPatch()
    mp.setattr(megatron_env, "RUNNER", Path(__file__))
    try:
        got = megatron_env.run(site, tasks, timeout=300)
    finally:
        mp.undo()
    return {(t["kind"], t["name"]): a for t, a in zip(tasks, got)}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_conv_and_scan_get_the_samples_spans(answers, name):
    batch = _batch(LAYOUTS[name])
    got = _answer(answers, "forward", name)
    spans = batch.cu_seqlens_padded
    want = spans if batch.max_num_seqs is None else pad_cu_seqlens(spans, batch.max_num_seqs)
    assert got["conv_cu_seqlens"] == want.tolist(), got
    assert got["scan_cu_seqlens"] == want.tolist(), got
    # the spans hold the samples: sample i's tokens start its span, pad slots follow
    for i, sample in enumerate(SAMPLES):
        a = int(spans[i])
        assert batch.input_ids[a:a + len(sample)].tolist() == sample
    assert got["conv_cu_seqlens"][len(SAMPLES)] == batch.input_ids.numel()  # the rest: zero-length sequences
    # each sample alone: no packed_seq_params, the kernels get no offsets
    assert got["alone_cu_seqlens"] == [None] * (2 * len(SAMPLES))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_fields_megatron_reads(answers, name):
    batch = _batch(LAYOUTS[name])
    fields = _answer(answers, "forward", name)["fields"]
    assert fields["type"] == "megatron.core.packed_seq_params.PackedSeqParams"
    assert fields["qkv_format"] == "thd"
    assert fields["cu_seqlens_q"][:len(SAMPLES) + 1] == batch.cu_seqlens.tolist()
    assert fields["cu_seqlens_kv"] == fields["cu_seqlens_q"]
    assert fields["cu_seqlens_kv_padded"] == fields["cu_seqlens_q_padded"]
    assert fields["total_tokens"] == batch.input_ids.numel()
    # built by megatron-core's PackedSeqParams.__post_init__ from total_tokens: [1, T], the sample of each slot
    assert fields["seq_idx"] == seq_idx(batch).tolist() and len(fields["seq_idx"]) == 1


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_pack_equals_each_sample_alone(answers, name):
    assert _answer(answers, "forward", name)["max_abs_diff"] < 1e-5


@pytest.mark.parametrize("name", sorted(CP_LAYOUTS))
def test_cp_shards_undo_to_the_stream(answers, name):
    got = _answer(answers, "cp_perm", name)
    batch = _batch(CP_LAYOUTS[name])
    assert got["resolved"] == [batch.cu_seqlens_padded.tolist()] * CP_LAYOUTS[name]["cp_size"]
    assert got["gathered_then_permuted"] == batch.input_ids.tolist()
    assert got["inverse_restores_gathered"]


def test_cp2_forward_equals_the_whole_pack(answers):
    got = _answer(answers, "cp_forward", "cp2")
    assert got["world_size"] == 2 and got["cp_size"] == 2
    assert got["scan_cu_seqlens"] == [_batch({"cp_size": 2, "pad_multiple": 4}).cu_seqlens_padded.tolist()] * 2
    assert got["max_abs_diff"] < 1e-5, got


# ---- the runner: started by megatron_env.run with PYTHONPATH = the unpacked wheels ----

RECORD: dict = {"conv": [], "scan": []}
SIZES = {"hidden": 64, "head_dim": 16}  # a smaller layer than the GPU check's: seconds on CPU
CHUNK = 16  # the scan stand-in's chunk (megatron's default 64 pads every span to 64 rows)


def _spans(x, cu_seqlens):
    bounds = [0, x.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _conv_standin(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, **_):
    """fla's ``causal_conv1d`` ([b, s, d], weight [d, w]) on CPU: a depthwise causal conv of each span."""
    import torch.nn.functional as F

    RECORD["conv"].append(None if cu_seqlens is None else cu_seqlens.tolist())
    assert initial_state is None and not output_final_state and activation in ("silu", "swish")
    out = torch.zeros_like(x)
    w = weight.shape[1]
    for a, b in _spans(x, cu_seqlens):
        seg = x[:, a:b].transpose(1, 2)
        y = F.conv1d(seg, weight.unsqueeze(1), bias, padding=w - 1, groups=weight.shape[0])[..., :b - a]
        out[:, a:b] = F.silu(y).transpose(1, 2)
    return out, None


def _scan_standin(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                  cu_seqlens=None, **_):
    """fla's ``chunk_gated_delta_rule`` on CPU: megatron-core's own ``torch_chunk_gated_delta_rule`` on each span."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    RECORD["scan"].append(None if cu_seqlens is None else cu_seqlens.tolist())
    out = torch.zeros_like(v)
    for a, b in _spans(q, cu_seqlens):
        out[:, a:b], _ = torch_chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                                      chunk_size=CHUNK, initial_state=initial_state,
                                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out, None


def _l2norm_standin(x, eps: float = 1e-6):
    """fla's ``l2norm``: ``x / sqrt(sum(x^2) + eps)`` over the last dimension."""
    return x * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps).to(x.dtype)


def _install_standins() -> None:
    """megatron-core's GDN on CPU: fla's kernels and the CUDA device replaced (see the module docstring)."""
    import megatron_run  # tests/megatron_run.py (this directory is sys.path[0])

    megatron_run._stub_packages()
    import megatron.core.parallel_state  # noqa: F401  (first: megatron.core.utils <-> parallel_state import cycle)
    from megatron.core.jit import disable_jit_fuser

    disable_jit_fuser()  # its fused helpers would be torch.compile'd on first import
    import megatron.core.ssm.gated_delta_net.common as common
    import megatron.core.ssm.gated_delta_net.gdn as gdn

    torch.cuda.current_device = lambda: torch.device("cpu")
    common.HAVE_FLA = True
    common.l2norm = _l2norm_standin
    gdn.causal_conv1d = _conv_standin
    gdn.chunk_gated_delta_rule = _scan_standin


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_megatron_gdn

    return gpu_megatron_gdn


def _fields(params) -> dict:
    out = {"type": type(params).__module__ + "." + type(params).__name__}
    for name in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                 "max_seqlen_q", "max_seqlen_kv", "total_tokens", "seq_idx"):
        value = getattr(params, name)
        out[name] = value.tolist() if isinstance(value, torch.Tensor) else value
    return out


def forward_task(task: dict, layer) -> dict:
    """megatron-core's GDN on the pack of ``layout`` and on each sample alone: the offsets its convolution and
    scan received, the pack's fields, the largest difference over real tokens."""
    bench = _bench()
    batch = _batch(task["layout"])
    RECORD["conv"].clear(), RECORD["scan"].clear()
    diff = bench.pack_vs_alone(layer, batch, torch.float32)
    conv, scan = list(RECORD["conv"]), list(RECORD["scan"])
    return {"conv_cu_seqlens": conv[0], "scan_cu_seqlens": scan[0], "alone_cu_seqlens": conv[1:] + scan[1:],
            "fields": _fields(to_packed_seq_params(batch)), "max_abs_diff": diff}


def cp_perm_task(task: dict) -> dict:
    """megatron-core's CP helpers on thdpack's shards: ``_resolve_cu_seqlens`` of each rank's
    ``to_packed_seq_params()`` at its local length x cp, and ``_build_thd_cp_a2a_perm`` applied to the shards
    concatenated in rank order (what the all-to-all gathers)."""
    from megatron.core.ssm.gated_delta_net.common import _build_thd_cp_a2a_perm, _GDNBase

    cp = task["layout"]["cp_size"]
    batch = _batch(task["layout"])
    shards = [thdpack.shard(batch, cp_size=cp, cp_rank=r) for r in range(cp)]
    resolved = []
    for shard in shards:
        p = to_packed_seq_params(shard)
        total = shard.input_ids.numel() * cp  # GDN: seq_len = hidden_states rows x sp x cp
        cu = _GDNBase._resolve_cu_seqlens(None, p.cu_seqlens_q_padded, p.cu_seqlens_q, total, "cu_seqlens_q", cp)
        cu_kv = _GDNBase._resolve_cu_seqlens(None, p.cu_seqlens_kv_padded, p.cu_seqlens_kv, total, "cu_seqlens_kv",
                                             cp)
        assert torch.equal(cu, cu_kv)
        resolved.append(cu.tolist())
    gathered = torch.cat([s.input_ids for s in shards])
    idx, inv = _build_thd_cp_a2a_perm(torch.tensor(resolved[0]), cp, gathered.numel())
    natural = gathered.index_select(0, idx)
    return {"resolved": resolved, "gathered_then_permuted": natural.tolist(),
            "inverse_restores_gathered": bool(torch.equal(natural.index_select(0, inv), gathered))}


def _cp_rank(rank: int, world: int, store: str, layout: dict, queue) -> None:
    """One CP rank of megatron-core's GDN (gloo): thdpack's shard and its ``to_packed_seq_params()`` in, the
    rank's output rows out. A forked child: megatron-core and the stand-ins are already loaded."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        bench = _bench()
        layer = bench.gdn_layer(torch.device("cpu"), torch.float32, cp_group=dist.group.WORLD, **SIZES)
        shard = thdpack.shard(_batch(layout), cp_size=world, cp_rank=rank)
        RECORD["scan"].clear()
        with torch.no_grad():
            out, _ = layer(bench.embed(shard.input_ids, "cpu", torch.float32, hidden=SIZES["hidden"]), None,
                           packed_seq_params=to_packed_seq_params(shard))
        queue.put((rank, out.squeeze(1).tolist(), RECORD["scan"][0], dist.get_world_size(), layer.cp_size, None))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # reported, not hung on
        import traceback

        queue.put((rank, None, None, None, None, traceback.format_exc()))


def start_cp_ranks(task: dict):
    """Fork the 2 CP ranks (before this process makes its own process group or runs torch ops)."""
    import multiprocessing
    import tempfile

    store = str(Path(tempfile.mkdtemp(prefix="thdpack_gdn_cp_")) / "store")  # gloo's rendezvous: no port to race for
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_cp_rank, args=(r, 2, store, task["layout"], queue)) for r in range(2)]
    for p in procs:
        p.start()
    return procs, queue, Path(store).parent


def cp_forward_task(task: dict, started, layer) -> dict:
    """Two gloo processes ran megatron-core's GDN at cp 2 on thdpack's shards; each rank's output rows are
    compared with the rows of the whole pack run at cp 1 (``layer``, the same parameters) at the shard's
    ``partition_indices``."""
    import shutil

    procs, queue, store_dir = started
    try:
        results = sorted((queue.get(timeout=120) for _ in procs), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(timeout=30)
        shutil.rmtree(store_dir, ignore_errors=True)
    errors = [r[5] for r in results if r[5]]
    if errors:
        raise RuntimeError("\n".join(errors))
    bench = _bench()
    batch = _batch(task["layout"])
    with torch.no_grad():
        whole, _ = layer(bench.embed(batch.input_ids, "cpu", torch.float32, hidden=SIZES["hidden"]), None,
                         packed_seq_params=to_packed_seq_params(batch))
    real = torch.zeros(batch.input_ids.numel(), dtype=torch.bool)
    for a, s in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.seq_lens.tolist()):
        real[a:a + s] = True
    diff = 0.0
    for rank, out, *_ in results:
        pos = thdpack.shard(batch, cp_size=2, cp_rank=rank).shard.partition_indices
        keep = real[pos]
        diff = max(diff, float((torch.tensor(out)[keep] - whole.squeeze(1)[pos][keep]).abs().max()))
    return {"max_abs_diff": diff, "scan_cu_seqlens": [r[2] for r in results], "world_size": results[0][3],
            "cp_size": results[0][4]}


def _main() -> None:
    sys.path.insert(0, str(ROOT))
    _install_standins()
    tasks = json.loads(sys.stdin.read())
    started = {id(t): start_cp_ranks(t) for t in tasks if t["kind"] == "cp_forward"}
    layer = _bench().gdn_layer(torch.device("cpu"), torch.float32, **SIZES)
    answers = []
    for task in tasks:
        try:
            if task["kind"] == "forward":
                answers.append(forward_task(task, layer))
            elif task["kind"] == "cp_perm":
                answers.append(cp_perm_task(task))
            else:
                answers.append(cp_forward_task(task, started[id(task)], layer))
        except Exception:  # megatron-core refusing a batch fails that task's tests, not the others'
            import traceback

            answers.append({"error": traceback.format_exc()})
    print(json.dumps(answers))


if __name__ == "__main__":
    _main()
