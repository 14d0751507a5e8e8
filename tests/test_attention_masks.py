"""Document ids and attention masks of a packed batch (thdpack.attention), checked with their consumers' code.

- transformers: tiny random Qwen3 / Llama with eager, sdpa and flex_attention, and Qwen2.5-VL with
  eager and sdpa, run on ``to_hf_kwargs(attn_implementation=...)``, give every sample the logits and
  the loss it has alone (the reference: the same weights, sdpa, the sample alone, no thdpack);
  where transformers does not derive the mask itself (a cache), ``attention_mask_4d`` does it;
- torchtitan: ``thdpack.batching.block_mask(batch)`` equals torchtitan's document mask (``get_document_mask_mod``
  and ``get_causal_mask_mod`` through torch's ``create_block_mask``) block for block, and its
  ``create_varlen_metadata_for_document`` finds the batch's ``cu_seqlens_padded``;
- hypothesis: on random layouts the dense mask, the BlockMask (its tables and its dense form) and
  the offsets agree with a mask written out from ``cu_seqlens_padded`` here, and with the tables
  torch's ``create_block_mask`` computes from that mask.

Every flex_attention run uses one stream length (``PAD_TO``), so transformers compiles
flex_attention once per process.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, create_mask  # noqa: E402

import test_equivalence as te  # noqa: E402
import test_vlm as tv  # noqa: E402
import thdpack  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402
from thdpack.attention.block_mask import document_block_mask  # noqa: E402
from thdpack.attention.dense_mask import dense_document_mask  # noqa: E402
from thdpack.attention import documents  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402
from thdpack.batching import attention_mask_4d, block_mask, document_ids, seq_idx  # noqa: E402

LOGIT_ATOL, LOSS_ATOL = te.LOGIT_ATOL, te.LOSS_ATOL
FLASH_KEYS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}

# a 300-token sample first (tiles of it are full blocks), 1-token samples, prompts masked
LENGTHS = [300, 1, 7, 2, 13, 1, 40, 3]
PROMPTS = [20, 0, 3, 1, 6, 0, 9, 2]
PAD_TO = 448  # every flex pack: one compile; 4 query tiles of 128, the last cut
PACKS = {
    "tail": {"pad_to": PAD_TO},  # no alignment, a pad_to tail in the last sample
    "pad8": {"pad_multiple": 8, "pad_to": PAD_TO},
    "cp2": {"cp_size": 2, "pad_to": PAD_TO},
    "plain": {},  # T = 367: not run with flex (a second shape would compile flex again)
}


@functools.lru_cache(maxsize=None)
def text_samples():
    return te.prompt_masked_samples(LENGTHS, PROMPTS, seed=23)


@functools.lru_cache(maxsize=None)
def text_alone(family: str):
    """Per sample ``(logits, ce, scored)`` of the sdpa model on the sample alone."""
    return [te.run_alone(te.tiny_model(family, "sdpa"), s) for s in text_samples()]


def text_model(family: str, attn: str):
    model = te.tiny_model(family, attn)
    reference = te.tiny_model(family, "sdpa")
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), f"{family}/{attn}: weight {name} differs from the sdpa reference"
    return model


@torch.no_grad()
def assert_packed_equals_alone(model, kw: dict, batch, alone, **call) -> None:
    """``model(**kw)`` on the pack gives each sample the logits of ``alone`` and HF's loss their mean CE."""
    out = model(**kw, **call)
    logits = out.logits[0]
    ce_sum, scored_sum = torch.zeros((), dtype=torch.float64), 0
    for i, (ref, ce, scored) in enumerate(alone):
        a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        diff = (logits[a : a + s] - ref).abs().max().item()
        assert diff < LOGIT_ATOL, f"sample {i} (len {s}): max |logit diff| {diff:.3g}"
        ce_sum += ce[scored].double().sum()
        scored_sum += int(scored.sum())
    torch.testing.assert_close(out.loss, (ce_sum / scored_sum).float(), rtol=0, atol=LOSS_ATOL)


# --------------------------------------------------------------------------- transformers text models


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flex_attention"])
@pytest.mark.parametrize("family", te.FAMILIES)
def test_text_models_attend_per_sample(family, attn):
    """The default call (the config's ``use_cache=True``, no keyword to remember) and ``use_cache=False``
    are both exact: every backend gets its mask and every layer type's boundaries."""
    model = text_model(family, attn)
    for name, layout in PACKS.items():
        if attn == "flex_attention" and name == "plain":
            continue
        batch = build_thd_batch(text_samples(), **layout)
        kw = to_hf_kwargs(batch, attn_implementation=attn)
        assert FLASH_KEYS | {"seq_idx", "attention_mask"} <= kw.keys()
        assert torch.equal(kw["seq_idx"], seq_idx(batch))
        if attn == "flex_attention":
            assert isinstance(kw["attention_mask"], BlockMask)
            assert kw["attention_mask"].shape == (1, 1, PAD_TO, PAD_TO)
        else:
            want = torch.bool if attn == "sdpa" else torch.float32
            assert torch.equal(kw["attention_mask"], attention_mask_4d(batch, want))
        assert_packed_equals_alone(model, kw, batch, text_alone(family))
        assert_packed_equals_alone(model, kw, batch, text_alone(family), use_cache=False)


@torch.no_grad()
def test_flex_model_reads_the_block_mask():
    """The equivalence above rests on thdpack's BlockMask, not on the position ids: the same
    kwargs with a one-document BlockMask (the pack as one sequence) move later samples' logits."""
    model = text_model("qwen3", "flex_attention")
    batch = build_thd_batch(text_samples(), **PACKS["pad8"])
    kw = to_hf_kwargs(batch, attn_implementation="flex_attention", include_labels=False)
    good = model(**kw, use_cache=False).logits[0]
    kw["attention_mask"] = document_block_mask([0, PAD_TO])
    leaky = model(**kw, use_cache=False).logits[0]
    a, s = int(batch.cu_seqlens_padded[-2]), int(batch.seq_lens[-1])
    ref = text_alone("qwen3")[-1][0]
    assert (good[a : a + s] - ref).abs().max().item() < LOGIT_ATOL
    assert (leaky[a : a + s] - ref).abs().max().item() > 100 * LOGIT_ATOL


@pytest.mark.parametrize("attn,dtype", [("sdpa", torch.bool), ("eager", torch.float32)])
def test_4d_mask_where_transformers_derives_none(attn, dtype):
    """With a cache (the configs' default ``use_cache=True``) transformers 5.x does not read packed
    ``position_ids``: without the 4D mask the pack attends as one sequence. ``to_hf_kwargs`` gives
    ``attention_mask_4d`` (bool for sdpa, additive float32 for eager), which keeps the samples apart."""
    model = text_model("llama", attn)
    batch = build_thd_batch(text_samples(), pad_multiple=8)
    kw = to_hf_kwargs(batch, attn_implementation=attn)
    no_mask = {k: v for k, v in kw.items() if k != "attention_mask"}
    with pytest.raises(AssertionError, match="logit diff"):
        assert_packed_equals_alone(model, no_mask, batch, text_alone("llama"), use_cache=True)
    mask = kw["attention_mask"]
    assert mask.dtype == dtype and mask.shape == (1, 1, batch.num_padded_tokens, batch.num_padded_tokens)
    assert_packed_equals_alone(model, kw, batch, text_alone("llama"), use_cache=True)


# --------------------------------------------------------------------------- Qwen2.5-VL


@functools.lru_cache(maxsize=None)
def vlm_model(attn: str):
    if attn == "sdpa":
        return tv.tiny_model("qwen2_5_vl")
    torch.manual_seed(1234)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tv.tiny_config("qwen2_5_vl")).float().eval()
    model.set_attn_implementation(attn)
    assert model.model.language_model.config._attn_implementation == attn
    return model


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_qwen2_5_vl_attends_per_sample(attn):
    model = vlm_model(attn)
    samples = tv.mixed_samples("qwen2_5_vl", seed=3)
    alone = [tv.run_alone(model, s) for s in samples]
    for layout in ({"pad_multiple": 4}, {"pad_multiple": 8, "pad_to": 512}):
        batch = build_thd_batch(samples, vlm=get_family(model.config), **layout)
        kw = to_hf_kwargs(batch, attn_implementation=attn)
        assert kw["position_ids"].shape == (4, 1, batch.num_padded_tokens)  # the text row keeps samples apart
        assert torch.equal(kw["attention_mask"], attention_mask_4d(batch, torch.bool if attn == "sdpa" else torch.float32))
        assert FLASH_KEYS | {"seq_idx"} <= kw.keys()  # transformers keeps them out of the vision tower
        assert_packed_equals_alone(model, kw, batch, alone)  # the default use_cache=True
        assert_packed_equals_alone(model, kw, batch, alone, use_cache=False)


def test_qwen_vl_text_models_refuse_flex_attention():
    """transformers 5.24 declares no flex_attention for the Qwen-VL text models
    (``_supports_flex_attn`` unset): ``thdpack.batching.block_mask(batch)`` serves text models and torchtitan there."""
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tv.tiny_config("qwen2_5_vl"))
    with pytest.raises(ValueError, match="does not support an attention implementation through torch's flex_attention"):
        model.set_attn_implementation("flex_attention")


# --------------------------------------------------------------------------- torchtitan


def _tables(mask: BlockMask) -> dict:
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    return {name: getattr(mask, name) for name in names}


def assert_same_block_mask(got: BlockMask, want: BlockMask) -> None:
    assert got.shape == want.shape and got.BLOCK_SIZE == want.BLOCK_SIZE
    for name, table in _tables(want).items():
        mine = _tables(got)[name]
        assert mine.dtype == table.dtype and mine.shape == table.shape, name
        assert torch.equal(mine, table), name
    assert torch.equal(got.to_dense(), want.to_dense())


@pytest.mark.parametrize("block_size", [128, (64, 128), (128, 32)])
@pytest.mark.parametrize(
    "layout", [{}, {"pad_multiple": 8}, {"cp_size": 2, "pad_to": 1024}, {"pad_multiple": 16, "pad_to": 896}],
    ids=["plain", "pad8", "cp2-pad_to", "pad16-pad_to"],
)
def test_block_mask_equals_torchtitan(layout, block_size):
    from torchtitan_env import create_varlen_metadata_for_document, get_causal_mask_mod, get_document_mask_mod

    samples = te.plain_samples(LENGTHS + [200, 130, 1], seed=5)
    batch = build_thd_batch(samples, **layout)
    T = batch.num_padded_tokens
    positions = batch.position_ids[None]  # torchtitan finds documents where positions restart at 0
    titan = create_block_mask(and_masks(get_causal_mask_mod(), get_document_mask_mod(positions)), 1, None, T, T,
                              device="cpu", BLOCK_SIZE=block_size)
    mine = block_mask(batch, block_size)
    assert_same_block_mask(mine, titan)
    dense = create_mask(titan.mask_mod, 1, 1, T, T)
    assert torch.equal(create_mask(mine.mask_mod, 1, 1, T, T), dense)
    assert torch.equal(attention_mask_4d(batch), dense)
    meta = create_varlen_metadata_for_document(positions)
    assert torch.equal(meta.cu_seq_q, batch.cu_seqlens_padded) and meta.max_q == batch.max_seqlen
    titan_ids = torch.cumsum((positions[0] == 0).int(), 0) - 1  # get_document_mask_mod's doc_ids
    assert torch.equal(document_ids(batch), titan_ids.to(torch.int32))


# --------------------------------------------------------------------------- random layouts


def reference_mask(cu: list[int], total: int) -> torch.Tensor:
    """bool ``[T, T]`` written out span by span: causal inside ``cu[i] : cu[i+1]``, the last span to ``total``."""
    mask = torch.zeros(total, total, dtype=torch.bool)
    ends = cu[1:-1] + [total]
    for a, b in zip(cu[:-1], ends):
        mask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return mask


def tile_dense(num: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    rows = indices.shape[-2]
    tiles = torch.zeros(rows, indices.shape[-1], dtype=torch.bool)
    for r in range(rows):
        tiles[r, indices[0, 0, r, : int(num[0, 0, r])].long()] = True
    return tiles


def token_dense(mask: BlockMask, total: int) -> torch.Tensor:
    """The BlockMask's token-level form: full tiles, and partial tiles where its mask_mod says so."""
    q_block, kv_block = mask.BLOCK_SIZE
    partial = tile_dense(mask.kv_num_blocks, mask.kv_indices)
    full = tile_dense(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (partial & full).any()
    assert torch.equal(mask.to_dense()[0, 0].bool(), partial | full)

    def expand(tiles):
        return tiles.repeat_interleave(q_block, 0).repeat_interleave(kv_block, 1)[:total, :total]

    return expand(full) | (expand(partial) & create_mask(mask.mask_mod, 1, 1, total, total)[0, 0])


@st.composite
def raw_layouts(draw):
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
    lengths[0] = max(lengths[0], 1)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = cu[-1] + draw(st.sampled_from([0, 0, 1, 9]))
    return cu, total


pytestmark = pytest.mark.usefixtures("static_flex_compiles")  # tests/conftest.py


BLOCKS = st.sampled_from([8, 16, (8, 16), (16, 8), (5, 7), 128])


@given(layout=raw_layouts(), block_size=BLOCKS)
@settings(deadline=None, max_examples=30)
def test_masks_agree_with_offsets(layout, block_size):
    """Offsets with empty spans (repeated entries) and a stream past ``cu[-1]``."""
    cu, total = layout
    want = reference_mask(cu, total)
    ids = documents.document_ids_from_offsets(torch.tensor(cu), total)
    assert ids.dtype == torch.int32 and ids.shape == (total,)
    assert torch.equal(want, (ids[:, None] == ids[None, :]) & torch.ones(total, total, dtype=torch.bool).tril())
    assert torch.equal(dense_document_mask(cu, total)[0, 0], want)
    additive = dense_document_mask(cu, total, dtype=torch.float16)[0, 0]
    assert torch.equal(additive == 0, want) and bool((additive[~want] == torch.finfo(torch.float16).min).all())
    mask = document_block_mask(cu, total, block_size=block_size)
    assert torch.equal(token_dense(mask, total), want)
    oracle = create_block_mask(lambda b, h, q, kv: want[q, kv], 1, None, total, total, device="cpu",
                               BLOCK_SIZE=block_size)
    assert_same_block_mask(mask, oracle)


@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6),
    align=st.sampled_from([{}, {"cp_size": 2}, {"pad_multiple": 8}, {"cp_size": 4, "pad_to": True}]),
    block_size=BLOCKS,
)
@settings(deadline=None, max_examples=25)
@pytest.mark.filterwarnings("ignore:thdpack. a batch of")  # 1-token samples: no target
def test_batch_masks_agree_with_cu_seqlens(lengths, align, block_size):
    """Batches built by thdpack: real tokens of sample i sit at ``cu_seqlens_padded[i] : + seq_lens[i]``
    and their document is i; pad slots and a ``pad_to`` tail are their sample's, as ``position_ids`` say."""
    align = dict(align)
    if align.get("pad_to"):  # a 16-token tail past the aligned stream (cp_size 4: multiples of 8)
        align["pad_to"] = sum(-(-n // 8) * 8 for n in lengths) + 16
    batch = build_thd_batch(te.plain_samples(lengths), **align)
    T, cu = batch.num_padded_tokens, batch.cu_seqlens_padded.tolist()
    ids = document_ids(batch)
    for i, (a, s) in enumerate(zip(cu[:-1], batch.seq_lens.tolist())):
        assert bool((ids[a : cu[i + 1]] == i).all())
        assert batch.position_ids[a : a + s].tolist() == list(range(s))
    assert torch.equal(ids, seq_idx(batch)[0])  # thdpack.attention.seq_idx: the same documents
    want = reference_mask(cu, T)
    assert torch.equal(attention_mask_4d(batch)[0, 0], want)
    assert torch.equal(token_dense(block_mask(batch, block_size), T), want)
    cp_size = align.get("cp_size", 1)
    for rank in range(cp_size if cp_size > 1 else 0):
        shard = thdpack.shard(batch, cp_size=cp_size, cp_rank=rank)
        assert torch.equal(document_ids(shard), ids[shard.shard.partition_indices])


# --------------------------------------------------------------------------- argument validation


def test_bad_arguments():
    batch = build_thd_batch(te.plain_samples([3, 5]), cp_size=2)
    for bad in (0, -1, True, 1.5, (8,), (8, 8, 8), (8, 0), (8, 2**31), "128", None):
        with pytest.raises(ValueError, match=r"block_size must be an integer >= 1 \(and < 2\*\*31\) or a \(q_blo"):
            block_mask(batch, bad)
    for bad in (torch.int64, "bool", float, None):
        with pytest.raises(ValueError, match="dtype must be torch.bool or a floating torch dtype"):
            attention_mask_4d(batch, bad)
    for bad in ("xformers", "flex", "SDPA", 3):
        with pytest.raises(ValueError, match="attn_implementation must be None, 'flash_attention_2'"):
            to_hf_kwargs(batch, attn_implementation=bad)
    for name in (None, "flash_attention_2", "flash_attention_3", "kernels-community/flash-attn3",
                 "paged|flash_attention_2"):
        assert to_hf_kwargs(batch, attn_implementation=name).keys() == to_hf_kwargs(batch).keys()
    shard = thdpack.shard(batch, cp_size=2, cp_rank=1)
    for call in (lambda: block_mask(shard), lambda: attention_mask_4d(shard),
                 lambda: to_hf_kwargs(shard, attn_implementation="sdpa"),
                 lambda: to_hf_kwargs(shard, attn_implementation="flex_attention")):
        with pytest.raises(ValueError, match=r"is for a whole batch, and this is a CP shard \(cp_size=2, rank 1\)"):
            call()
    assert "cu_seq_lens_q" in to_hf_kwargs(shard, attn_implementation="flash_attention_2")

    for fn in (documents.document_ids_from_offsets, document_block_mask, dense_document_mask):
        with pytest.raises(ValueError, match=r"must start at 0 and never decrease, got \[0, 5, 3\]"):
            fn([0, 5, 3])
        with pytest.raises(ValueError, match=r"must start at 0 and never decrease, got \[1, 5\]"):
            fn(torch.tensor([1, 5]))
        with pytest.raises(ValueError, match=r"1-D with at least 2 entries \(one sample\), got shape \(1,\)"):
            fn([0])
        with pytest.raises(ValueError, match=r"1-D with at least 2 entries \(one sample\), got shape \(1, 2\)"):
            fn([[0, 4]])
        with pytest.raises(ValueError, match="cu_seqlens_padded must hold integers"):
            fn(torch.tensor([0.0, 4.0]))
        with pytest.raises(ValueError, match=r"describes an empty stream \(\[0, 0\]\)"):
            fn([0, 0])
        with pytest.raises(ValueError, match=r"total must be an integer >= 8, got 7 \(the stream length; "
                                             r"cu_seqlens_padded\[-1\] is 8\)"):
            fn([0, 3, 8], 7)
        with pytest.raises(ValueError, match=r"total must be an integer >= 1, got 0"):
            fn([0, 0], 0)
        with pytest.raises(TypeError, match="cu_seqlens_padded must be integers"):
            fn(None)
