"""Fixtures several test modules share."""

import pytest


@pytest.fixture
def static_flex_compiles():
    """Compile for the shapes seen (no automatic dynamic shapes). Test modules run FlexAttention at
    different stream lengths in one xdist worker; after a second length dynamo would recompile
    flex_attention with a dynamic one, whose CPU code torch 2.13's inductor fails to compile
    (``cur_qSplitSize8 was not declared``). Each length then compiles once, statically."""
    import torch._dynamo

    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield


def pytest_configure(config):
    """One intra-op thread per test process: the suite runs in 2 xdist workers on 2 cores, and its models
    are tiny, so two threads per worker only contend (a tiny hybrid model's test: 0.4 s alone, 10+ s with
    both workers' threads oversubscribing the cores). Subprocesses the tests start keep torch's default."""
    import torch

    torch.set_num_threads(1)
