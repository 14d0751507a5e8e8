"""Issue 43, ``packed_model`` and the integrations' entry points under bad input.

- A full-attention model prepared by ``packed_model`` and given packed ``position_ids`` (restarting at 0 inside
  one row) but no boundaries was run across the samples under the config's ``use_cache=True`` (and always on
  the varlen backend): now exact on sdpa, eager, flex_attention and ``thdpack_varlen``, or refused; plain
  rows, padded batches and generation are unchanged.
- ``packed_model``, ``router_aux_loss``, ``to_gpt_forward_kwargs`` / ``to_bridge_batch`` given the wrong kind of
  object: one ``TypeError`` (``ValueError`` for an empty or malformed value) naming the argument.
- ``FlopsCallback``'s boolean options follow the one boolean rule (``check_bool``).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from thdpack import build_thd_batch  # noqa: E402
from thdpack.demo.models import TINY_TEXT  # noqa: E402
from thdpack.integrations import FlopsCallback, packed_model, register_varlen_attention  # noqa: E402
from thdpack.integrations.megatron_bridge import to_bridge_batch, to_gpt_forward_kwargs  # noqa: E402
from thdpack.integrations.moe_router import router_aux_loss  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402

VOCAB = 128
ATOL = 1e-4
VARLEN = register_varlen_attention()
BACKENDS = ("sdpa", "eager", "flex_attention", VARLEN)
MODELS = [pytest.param(f, a, id=f"{f}-{a}") for f in ("qwen3", "llama") for a in BACKENDS]
NOT_OBJECTS = st.one_of(st.none(), st.text(max_size=5), st.integers(), st.floats(allow_nan=False),
                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                        st.lists(st.integers(), max_size=3))


def fresh_model(family: str, attn: str, **extra) -> torch.nn.Module:
    """A new 2-layer random-weight causal LM (fp32, eval): ``packed_model`` changes the instance it gets."""
    common = dict(vocab_size=VOCAB, **TINY_TEXT, max_position_embeddings=512, initializer_range=0.2, **extra)
    torch.manual_seed(1234)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model.config._attn_implementation = attn
    return model.to(torch.float32).eval()


def tokens(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def packed_row(samples) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and restarting ``position_ids``, int64 ``[1, T]``: what a packing collator without
    boundaries (``DataCollatorWithFlattening`` by default) gives."""
    ids = torch.tensor([sum(samples, [])])
    positions = torch.tensor([[p for s in samples for p in range(len(s))]])
    return ids, positions


@torch.no_grad()
def alone(model, samples) -> torch.Tensor:
    """Each sample's logits run alone, concatenated: ``[T, vocab]``."""
    return torch.cat([model(input_ids=torch.tensor([s])).logits[0] for s in samples])


def worst(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max())


# --------------------------------------------------------------------------- packed positions, no boundaries


@pytest.mark.parametrize("family,attn", MODELS)
@torch.no_grad()
def test_packed_positions_without_boundaries_are_exact(family, attn, static_flex_compiles):
    """Before: the raw call (and packed_model's) attended across the samples, logits several units off."""
    model = fresh_model(family, attn)
    samples = tokens([6, 3, 5, 1, 4])
    ids, positions = packed_row(samples)
    want = alone(model, samples)
    assert worst(model(input_ids=ids, position_ids=positions).logits[0], want) > 1e-2  # the config's use_cache
    packed_model(model)
    for options in ({}, {"use_cache": True}, {"use_cache": False}):
        got = model(input_ids=ids, position_ids=positions, **options).logits[0]
        assert worst(got, want) < ATOL, options


@pytest.mark.parametrize("attn", ["sdpa", VARLEN])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_any_packed_row_without_boundaries_is_exact(attn, lengths, seed):
    model = _prepared("qwen3", attn)
    samples = tokens(lengths, seed)
    ids, positions = packed_row(samples)
    assert worst(model(input_ids=ids, position_ids=positions).logits[0], alone(model, samples)) < ATOL


_MODELS: dict = {}


def _prepared(family: str, attn: str):
    if (family, attn) not in _MODELS:
        _MODELS[family, attn] = packed_model(fresh_model(family, attn))
    return _MODELS[family, attn]


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
@torch.no_grad()
def test_several_packed_rows_without_boundaries_are_exact(attn, static_flex_compiles):
    model = packed_model(fresh_model("qwen3", attn))
    rows = [tokens([4, 3], 1), tokens([2, 5], 2)]
    ids = torch.cat([packed_row(r)[0] for r in rows])
    positions = torch.cat([packed_row(r)[1] for r in rows])
    got = model(input_ids=ids, position_ids=positions).logits
    for i, row in enumerate(rows):
        assert worst(got[i], alone(model, row)) < ATOL


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_a_thdpack_batch_without_its_boundaries_is_exact(attn):
    """Only input_ids and position_ids of an aligned pack (pad slots continue their sample's count)."""
    model = packed_model(fresh_model("llama", attn))
    samples = tokens([5, 2, 7])
    batch = build_thd_batch([{"input_ids": s} for s in samples], pad_multiple=4)
    kw = to_hf_kwargs(batch)
    logits = model(input_ids=kw["input_ids"], position_ids=kw["position_ids"]).logits[0]
    starts = batch.cu_seqlens_padded.tolist()
    for a, s in zip(starts, samples):
        assert worst(logits[a:a + len(s)], alone(model, [s])) < ATOL


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_sliding_window_model_with_packed_positions_keeps_its_window(attn):
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        initializer_range=0.2, max_position_embeddings=512, sliding_window=4)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = packed_model(transformers.MistralForCausalLM(config).eval())
    samples = tokens([9, 3, 12])
    ids, positions = packed_row(samples)
    assert worst(model(input_ids=ids, position_ids=positions).logits[0], alone(model, samples)) < ATOL


@pytest.mark.parametrize("attn", BACKENDS)
@torch.no_grad()
def test_plain_calls_are_unchanged(attn, static_flex_compiles):
    """A single sample (position_ids = arange or none), a padded [B, S] batch and generation give what the model
    gives without packed_model, its cache included."""
    raw, model = fresh_model("qwen3", attn), packed_model(fresh_model("qwen3", attn))
    ids = torch.tensor(tokens([7]))
    for options in ({}, {"position_ids": torch.arange(7)[None]}):
        want, got = raw(input_ids=ids, **options), model(input_ids=ids, **options)
        assert torch.equal(got.logits, want.logits)
        assert got.past_key_values is not None and got.past_key_values.get_seq_length() == 7
    if attn == VARLEN:
        return  # thdpack_varlen takes no padding mask, and generate() passes one
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # transformers' generate: left padding
    batch = {"input_ids": torch.cat([ids, ids]), "attention_mask": mask, "position_ids": positions}
    assert torch.equal(model(**batch).logits, raw(**batch).logits)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **options), raw.generate(ids, **options))


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention", VARLEN])
@torch.no_grad()
def test_packed_positions_with_an_all_ones_mask_are_exact(attn, static_flex_compiles):
    model = packed_model(fresh_model("qwen3", attn))
    samples = tokens([4, 6, 2])
    ids, positions = packed_row(samples)
    got = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids)).logits[0]
    assert worst(got, alone(model, samples)) < ATOL


@torch.no_grad()
def test_packed_positions_that_cannot_be_kept_apart_are_refused():
    samples = tokens([4, 6, 2])
    ids, positions = packed_row(samples)
    model = packed_model(fresh_model("qwen3", "sdpa"))
    mask = torch.ones_like(ids)
    mask[0, -1] = 0  # a padding mask with a pad slot: transformers ignores the restarts then
    with pytest.raises(ValueError, match="padding mask with pad slots"):
        model(input_ids=ids, position_ids=positions, attention_mask=mask)
    cache = transformers.DynamicCache(config=model.config)
    with pytest.raises(ValueError, match="continues a cache"):
        model(input_ids=ids, position_ids=positions, past_key_values=cache)
    varlen = packed_model(fresh_model("qwen3", VARLEN))
    with pytest.raises(ValueError, match="with 2 rows thdpack cannot keep the samples apart"):
        varlen(input_ids=torch.cat([ids, ids]), position_ids=torch.cat([positions, positions]))


# --------------------------------------------------------------------------- wrong objects


@settings(max_examples=25, deadline=None)
@given(value=NOT_OBJECTS)
def test_packed_model_takes_a_module(value):
    with pytest.raises(TypeError, match="packed_model takes a transformers model .*, got "):
        packed_model(value)


@pytest.fixture(scope="module")
def qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(3)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def test_router_aux_loss_names_what_it_takes(qwen3_moe):
    batch = build_thd_batch([{"input_ids": [3, 4, 5]}, {"input_ids": [6, 7]}], pad_multiple=4)
    layer = torch.zeros(batch.num_padded_tokens, 8)
    for logits in (None, layer, {"0": layer}, "logits"):
        with pytest.raises(TypeError, match="router_logits must be a tuple or list of .*tensors"):
            router_aux_loss(qwen3_moe, logits, batch)
    with pytest.raises(TypeError, match=r"router_logits\[1\] must be a \[T, num_experts\] tensor, got NoneType"):
        router_aux_loss(qwen3_moe, (layer, None), batch)
    for empty in ((), []):
        with pytest.raises(ValueError, match="router_logits is empty"):
            router_aux_loss(qwen3_moe, empty, batch)
    with pytest.raises(ValueError, match=r"router_logits\[0\] must be \[T, num_experts\] with the model's 8"):
        router_aux_loss(qwen3_moe, (torch.zeros(batch.num_padded_tokens, 5),), batch)
    with pytest.raises(TypeError, match="batch must be the thdpack.ThdBatch .*, got dict"):
        router_aux_loss(qwen3_moe, (layer,), to_hf_kwargs(batch))
    with pytest.raises(TypeError, match="model must be a transformers MoE model .*, got NoneType"):
        router_aux_loss(None, (layer,), batch)
    assert torch.isfinite(router_aux_loss(qwen3_moe, [layer, layer], batch))  # a list is taken


@settings(max_examples=25, deadline=None)
@given(value=NOT_OBJECTS)
def test_megatron_conversions_take_a_batch(value):
    for convert in (to_gpt_forward_kwargs, to_bridge_batch):
        with pytest.raises(TypeError, match=f"{convert.__name__} takes a thdpack.ThdBatch .*, got "):
            convert(value)


@settings(max_examples=25, deadline=None)
@given(label=st.one_of(st.floats(allow_nan=False), st.text(max_size=3), st.booleans(), st.none()))
def test_ignore_label_is_an_integer(label):
    batch = build_thd_batch([{"input_ids": [3, 4, 5]}])
    for convert in (to_gpt_forward_kwargs, to_bridge_batch):
        with pytest.raises(ValueError, match="ignore_label must be an integer"):
            convert(batch, ignore_label=label)
    assert to_gpt_forward_kwargs(batch, ignore_label=-100)["labels"].tolist() == [[4, 5, -100]]


@settings(max_examples=25, deadline=None)
@given(value=st.one_of(st.text(max_size=4), st.integers(), st.floats(allow_nan=False), st.lists(st.booleans())))
def test_flops_callback_booleans(value):
    for name in ("include_data_time", "count_padding", "synchronize", "all_reduce"):
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            FlopsCallback(**{name: value})
    assert FlopsCallback(synchronize=None, all_reduce=None, count_padding=True).count_padding is True
