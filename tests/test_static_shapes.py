"""Static shapes (issue 23 point 3): ``pad_to`` + ``max_num_seqs`` give every batch one shape.

The model test runs a tiny random Qwen3 through transformers' own flash-attention path
(``integrations.flash_attention.flash_attention_forward`` → ``_flash_attention_forward``, which hands
``cu_seq_lens_q/k`` and ``max_length_q/k`` of ``to_hf_kwargs`` to ``flash_attn_varlen_func``) under
``torch.compile(dynamic=False)``. flash-attn cannot run on the CPU, so the kernel under it is a plain
reference with ``flash_attn_varlen_func``'s signature and contract (written here, checked against
transformers' sdpa per sample): sequence ``b`` spans ``cu_seqlens[b] : cu_seqlens[b + 1]`` and the work
is laid out over ``num_seqs × max_seqlen`` as flash-attn's grid is, so both the number of sequences and
``max_seqlen`` are part of the compiled graph's shape, as they are of a captured CUDA graph. sdpa alone
would not notice: its graph reads neither (measured: it compiles once even without ``max_num_seqs``).

The model runs in float64: transformers' flash path casts float32 inputs "back" with a
``logger.warning_once`` that breaks the graph; float64 inputs are left alone (and compare exactly).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import thdpack
from thdpack import StreamingPacker, ThdCollator, build_thd_batch
from thdpack.batching import BatchLayout, static_cu_seqlens, static_cu_seqlens_padded, static_max_seqlen
from thdpack.flops import FlopsAccumulator, seqlen_squared_sum
from thdpack.losses import packed_loss
from thdpack.attention.static import pad_cu_seqlens
from thdpack.demo.models import TINY_TEXT
from thdpack.integrations import packed_seq_params_dict, to_hf_kwargs

transformers = pytest.importorskip("transformers")

VOCAB = 128
PACK = 48  # pad_to: every stream is 48 tokens
MAX_SEQS = 6
ATTN = "thdpack_reference_varlen"


# --------------------------------------------------------------------------- a varlen kernel for the CPU


def reference_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    """``flash_attn_varlen_func`` on the CPU: q ``[total_q, H, D]``, k / v ``[total_k, H_kv, D]``, out
    ``[total_q, H, D]``. Like flash-attn, it gathers each sequence into a ``max_seqlen`` tile, reads the
    sequence's bounds from the offsets (a zero-length sequence writes nothing), and aligns the causal
    mask bottom-right."""
    total_q, heads, dim = q.shape
    total_k = k.shape[0]
    cu_q, cu_k = cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    off_q = torch.arange(max_seqlen_q, device=q.device)
    off_k = torch.arange(max_seqlen_k, device=q.device)
    rows_q, rows_k = cu_q[:-1, None] + off_q, cu_k[:-1, None] + off_k  # [num_seqs, max_seqlen]
    valid_q, valid_k = off_q < len_q[:, None], off_k < len_k[:, None]
    group = heads // k.shape[1]
    qg = q[rows_q.clamp(max=total_q - 1)]
    kg = k[rows_k.clamp(max=total_k - 1)].repeat_interleave(group, dim=2)
    vg = v[rows_k.clamp(max=total_k - 1)].repeat_interleave(group, dim=2)
    scale = softmax_scale if softmax_scale is not None else dim**-0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", qg, kg) * scale
    allowed = valid_k[:, None, None, :].expand(-1, 1, max_seqlen_q, -1)
    if causal:
        shift = (len_k - len_q)[:, None, None, None]
        allowed = allowed & (off_k[None, None, None, :] <= off_q[None, None, :, None] + shift)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vg)
    index = torch.where(valid_q, rows_q, total_q).reshape(-1)  # rows past a sequence go to a dropped row
    return q.new_zeros(total_q + 1, heads, dim).index_add_(0, index, out.reshape(-1, heads, dim))[:total_q]


def reference_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    deterministic=False):
    """``flash_attn_func`` (``[B, S, H, D]``, one sequence per row) through :func:`reference_flash_varlen`."""
    b, s = q.shape[:2]
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    flat = [x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)]
    return reference_flash_varlen(*flat, cu, cu, s, s, softmax_scale=softmax_scale, causal=causal).reshape(q.shape)


@pytest.fixture(scope="module")
def models():
    """``(varlen, sdpa)``: one tiny random Qwen3 (float64, eval), on transformers' flash path with the
    reference kernel, and the same weights on transformers' sdpa."""
    import transformers.modeling_flash_attention_utils as fa
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import flash_attention_mask

    original = fa._lazy_imports

    def lazy_imports(implementation, *args, **kwargs):
        if implementation == ATTN:
            return reference_flash, reference_flash_varlen, None, fa._pad_input, fa._unpad_input
        return original(implementation, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(fa, "_lazy_imports", lazy_imports)
    AttentionInterface.register(ATTN, flash_attention_forward)
    AttentionMaskInterface.register(ATTN, flash_attention_mask)
    fa.lazy_import_flash_attention(ATTN)  # before compiling, as transformers asks for fullgraph
    config = dict(vocab_size=VOCAB, **TINY_TEXT, max_position_embeddings=512, initializer_range=0.2)
    torch.manual_seed(1234)
    varlen = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config, attn_implementation=ATTN))
    sdpa = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config, attn_implementation="sdpa"))
    sdpa.load_state_dict(varlen.state_dict())
    yield varlen.to(torch.float64).eval(), sdpa.to(torch.float64).eval()
    patch.undo()
    fa._loaded_implementation = None


@pytest.fixture(scope="module")
def packs():
    """``(samples, batches)``: 20+ packs of 1..6 samples of random lengths, all ``pad_to=PACK``,
    ``max_num_seqs=MAX_SEQS``, planned by ThdCollator."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 24, (80,), generator=g).tolist()
    samples = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    collator = ThdCollator(pack_size=PACK, algorithm="first_fit_shuffle", pad_to=PACK, max_num_seqs=MAX_SEQS)
    batches = collator(samples)
    assert len(batches) >= 20
    return samples, list(batches)


# --------------------------------------------------------------------------- the model tests


@torch.no_grad()
def test_compiles_once_over_20_packs_and_equals_eager(models, packs):
    from torch._dynamo.testing import CompileCounterWithBackend

    varlen, _ = models
    batches = packs[1][:20]
    assert len({b.num_samples for b in batches}) >= 4 and len({b.num_tokens for b in batches}) >= 4  # contents differ
    # no torch._dynamo.reset(): it would drop other tests' compiled functions in this process; the
    # counter is this test's own backend, and counts only what this torch.compile compiles
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(varlen, backend=counter, dynamic=False, fullgraph=True)
    for i, batch in enumerate(batches):
        kw = to_hf_kwargs(batch)
        out = compiled(**kw, use_cache=False)
        assert counter.frame_count == 1, f"pack {i} ({batch.num_samples} samples) compiled again"
        eager = varlen(**kw, use_cache=False)
        torch.testing.assert_close(out.logits, eager.logits, rtol=0, atol=1e-12)
        torch.testing.assert_close(out.loss, eager.loss, rtol=0, atol=1e-12)
    shapes = {tuple((k, tuple(v.shape) if isinstance(v, torch.Tensor) else v)
                    for k, v in sorted(to_hf_kwargs(b).items())) for b in batches}
    assert len(shapes) == 1, shapes  # one shape: every tensor, and max_length_q/k


@torch.no_grad()
def test_static_packs_give_each_sample_as_alone(models, packs):
    """Packed through the varlen path with the static offsets (zero-length sequences, max_seqlen =
    the stream) = each sample alone on transformers' sdpa: logits and loss."""
    varlen, sdpa = models
    samples, batches = packs
    chosen = [max(batches, key=lambda b: b.num_samples), min(batches, key=lambda b: b.num_samples)]
    for batch in chosen:
        kw = to_hf_kwargs(batch)
        assert kw["cu_seq_lens_q"].shape == (MAX_SEQS + 1,) and kw["max_length_q"] == PACK
        out = varlen(**kw, use_cache=False)
        ce = F.cross_entropy(out.logits[0], batch.labels, ignore_index=batch.ignore_index, reduction="none")
        alone_ce = []
        for a, s, i in zip(batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist(), batch.sample_index.tolist()):
            ids = torch.tensor(samples[i]["input_ids"])
            alone = sdpa(input_ids=ids[None], use_cache=False).logits[0]
            torch.testing.assert_close(out.logits[0, a : a + s], alone, rtol=0, atol=1e-9)
            alone_ce.append(F.cross_entropy(alone[:-1], ids[1:], reduction="none"))
            torch.testing.assert_close(ce[a : a + s - 1], alone_ce[-1], rtol=0, atol=1e-9)
        torch.testing.assert_close(out.loss.double(), torch.cat(alone_ce).mean(), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- the offsets


def test_pad_cu_seqlens_repeats_the_last_value():
    cu = torch.tensor([0, 5, 7, 11], dtype=torch.int32)
    assert pad_cu_seqlens(cu, 6).tolist() == [0, 5, 7, 11, 11, 11, 11]
    assert pad_cu_seqlens(cu, 3).tolist() == cu.tolist()  # already n == max_num_seqs
    assert pad_cu_seqlens(cu.to(torch.int64), 4).dtype == torch.int32
    batch = build_thd_batch([{"input_ids": [1] * n} for n in (5, 2, 4)], pad_to=16, max_num_seqs=5)
    assert static_cu_seqlens(batch).tolist() == [0, 5, 7, 11, 11, 11]
    assert static_cu_seqlens_padded(batch).tolist() == [0, 5, 7, 16, 16, 16]  # the tail is the last sample's
    assert static_max_seqlen(batch) == 16 and batch.max_seqlen == 9
    assert batch.cu_seqlens.tolist() == [0, 5, 7, 11] and batch.num_samples == 3


def test_more_samples_than_max_num_seqs_names_the_batchs_samples():
    samples = [{"input_ids": [1, 2]}] * 5
    message = r"^a batch of 5 samples does not fit max_num_seqs=4: plan at most 4 samples per pack"
    with pytest.raises(ValueError, match=message):
        build_thd_batch(samples, max_num_seqs=4)
    with pytest.raises(ValueError, match=message):
        ThdCollator(max_num_seqs=4)(samples)
    with pytest.raises(ValueError, match=message):
        pad_cu_seqlens(torch.arange(6, dtype=torch.int32), 4)
    batch = build_thd_batch(samples, max_num_seqs=5)
    assert static_cu_seqlens(batch).shape == (6,)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "4", 2**63])
def test_max_num_seqs_must_be_a_size(value):
    message = r"^max_num_seqs must be an integer >= 1.*got "
    for make in (lambda: BatchLayout(max_num_seqs=value), lambda: ThdCollator(max_num_seqs=value),
                 lambda: build_thd_batch([{"input_ids": [1]}], max_num_seqs=value)):
        with pytest.raises(ValueError, match=message):
            make()


@pytest.mark.parametrize("cap,want", [(None, 3), (2, 2), (8, 3)])
def test_collator_plans_at_most_max_num_seqs(cap, want):
    samples = [{"input_ids": [1, 2]} for _ in range(20)]  # 10 of them would fit a pack of 24 tokens
    collator = ThdCollator(pack_size=24, max_samples_per_pack=cap, pad_to=24, max_num_seqs=3)
    assert collator.options.max_samples_per_pack == want
    batches = collator(samples)
    assert max(b.num_samples for b in batches) == want
    assert {tuple(to_hf_kwargs(b)["cu_seq_lens_q"].shape) for b in batches} == {(4,)}


def test_streaming_packer_with_a_static_collator():
    """StreamingPacker plans (max_samples_per_pack), the collator pads: one shape for every pack."""
    samples = [{"input_ids": list(range(1, 2 + i % 7))} for i in range(40)]
    packer = StreamingPacker(samples, 16, max_samples_per_pack=4, num_replicas=1, rank=0)
    collator = ThdCollator(pad_to=16, max_num_seqs=4)
    batches = [collator(pack) for pack in packer]
    assert {b.input_ids.shape + static_cu_seqlens(b).shape + static_cu_seqlens_padded(b).shape for b in batches} == {
        (16, 5, 5)}
    assert sum(b.num_samples for b in batches) == 40


# --------------------------------------------------------------------------- nothing per-sample changes


def _counts(what) -> tuple:
    acc = FlopsAccumulator().add(what)
    return tuple(int(getattr(acc, k)) for k in ("samples", "tokens", "padded_tokens", "seqlen_squared_sum"))


def _assert_same_batch(static, plain) -> None:
    """Every tensor field and per-sample view of ``static`` equals ``plain``'s."""
    for name, value in vars(plain).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(static, name), value), name
    assert static.num_samples == plain.num_samples and seqlen_squared_sum(static) == seqlen_squared_sum(plain)
    assert _counts(static) == _counts(plain)  # FLOPs from the batch (real lengths)
    assert _counts(to_hf_kwargs(static)) == _counts(to_hf_kwargs(plain))  # ... and from the model inputs
    logits = torch.randn(static.num_padded_tokens, 16, generator=torch.Generator().manual_seed(0))  # ids < 16
    for reduction in ("token",) if static.is_shard else ("token", "sample"):
        assert torch.equal(packed_loss(logits, static, reduction), packed_loss(logits, plain, reduction))


@pytest.mark.filterwarnings("ignore:thdpack. a batch of")  # 1-token samples have no target
@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6), spare=st.integers(0, 3),
       cp_size=st.sampled_from([1, 2]), pad_multiple=st.sampled_from([None, 4]), extra=st.sampled_from([None, 0, 8]))
def test_max_num_seqs_pads_only_what_kernels_read(lengths, spare, cp_size, pad_multiple, extra):
    samples = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    layout = dict(cp_size=cp_size, pad_multiple=pad_multiple)
    aligned = build_thd_batch(samples, **layout)
    pad_to = None if extra is None else aligned.num_padded_tokens + extra * aligned.pad_multiple
    n, m = len(lengths), len(lengths) + spare
    plain = build_thd_batch(samples, **layout, pad_to=pad_to)
    static = build_thd_batch(samples, **layout, pad_to=pad_to, max_num_seqs=m)
    _assert_same_batch(static, plain)
    T = plain.num_padded_tokens
    for got, real in ((static_cu_seqlens(static), plain.cu_seqlens), (static_cu_seqlens_padded(static),
                                                                     plain.cu_seqlens_padded)):
        assert got.shape == (m + 1,) and got.dtype == torch.int32
        assert got[: n + 1].tolist() == real.tolist() and bool((got[n:] == real[-1]).all())
    kw = to_hf_kwargs(static)
    assert torch.equal(kw["cu_seq_lens_q"], static_cu_seqlens_padded(static)) and kw["max_length_q"] == T
    params = packed_seq_params_dict(static)
    assert torch.equal(params["cu_seqlens_q"], static_cu_seqlens(static))
    assert torch.equal(params["cu_seqlens_q_padded"], static_cu_seqlens_padded(static))  # always set
    assert params["max_seqlen_q"] == params["max_seqlen_kv"] == params["total_tokens"] == T
    for rank in range(cp_size if cp_size > 1 else 0):
        shards = (thdpack.shard(static, cp_size=cp_size, cp_rank=rank),
                  build_thd_batch(samples, **layout, pad_to=pad_to, max_num_seqs=m, cp_rank=rank))
        for shard in shards:  # whole-batch sharding and the direct shard alike
            _assert_same_batch(shard, thdpack.shard(plain, cp_size=cp_size, cp_rank=rank))
            local = to_hf_kwargs(shard)
            assert torch.equal(local["cu_seq_lens_q"], static_cu_seqlens_padded(static) // cp_size)
            assert local["max_length_q"] == T // cp_size


def test_bridge_batches_get_the_static_offsets():
    """to_bridge_batch of a max_num_seqs batch: [1, M+1] offsets with the last value repeated, the stream length
    as max_seqlen, so Megatron-Bridge's step sees one shape; without max_num_seqs the real offsets as before."""
    from thdpack.integrations.megatron_bridge import to_bridge_batch

    samples = [{"input_ids": list(range(3, 3 + n))} for n in (5, 9, 2)]
    static = to_bridge_batch(build_thd_batch(samples, pad_to=32, max_num_seqs=6, pad_multiple=2))
    assert static["cu_seqlens_q"].tolist() == [[0, 5, 14, 16, 16, 16, 16]]
    assert static["cu_seqlens_q_padded"].tolist() == [[0, 6, 16, 32, 32, 32, 32]]
    assert static["max_seqlen_q"].tolist() == [[32]]
    plain = to_bridge_batch(build_thd_batch(samples))
    assert plain["cu_seqlens_q"].tolist() == [[0, 5, 14, 16]] and plain["max_seqlen_q"].tolist() == [[9]]
