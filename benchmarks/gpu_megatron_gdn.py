"""megatron-core's own Gated DeltaNet layer on thdpack packs, on a GPU (issue 29 point 6).

``megatron_gdn_check()`` runs ``megatron.core.ssm.gated_delta_net.GatedDeltaNet`` (megatron-core >= 0.18: its
``qkv_format == "thd"`` path; a tiny config, bf16) once on a thdpack pack, with ``to_packed_seq_params(ThdBatch)``,
and once on each sample alone (no ``packed_seq_params``), and returns the largest difference over the real tokens:
``{"max_abs_diff", "tolerance", "cases": {...}}``, one case per layout (no padding; ``pad_multiple=8``; static
shapes: ``max_num_seqs`` with 3 spare sequences and ``pad_to``). Called by ``benchmarks/gpu_check.py``.

It needs CUDA, flash-linear-attention (``fla``: the layer's ``causal_conv1d``, ``l2norm`` and
``chunk_gated_delta_rule``, which read the pack's ``cu_seqlens``) and megatron-core: an installed one, else the
wheel tests/megatron_env.py unpacks (``$THDPACK_CACHE/megatron-bridge-0.6.2-core-0.19.2/site``; on a machine without
a package index set ``THDPACK_CACHE`` to a copy of that cache). Without one of them it returns
``{"skipped": "<why>"}`` and never raises; a run that fails returns ``{"error": ...}``.

megatron-core is imported in a subprocess, with the package ``__init__`` files stubbed as tests/megatron_run.py
does (they import the model zoo and optional kernels; the GDN module and what it imports load unchanged), so that
nothing of it leaks into the caller. The layer's linear projections are plain ``torch.nn.Linear`` (megatron's
are tensor-parallel wrappers of the same product; what is checked is the token mixing), its output norm
megatron-core's ``WrappedTorchNorm``, its process groups a one-rank gloo group.

Usage::

    python benchmarks/gpu_megatron_gdn.py           # prints the result as JSON (what megatron_gdn_check returns)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 2e-2  # bf16, as gpu_check's kernel checks
# tiny but kernel-friendly: fla's chunked kernels want head dims that are multiples of 16
HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM, CONV_KERNEL, VOCAB = 256, 2, 4, 64, 4, 1000


def _tests_module(name: str):
    """tests/<name>.py (tests/ is not a package): the megatron helpers the test suite uses."""
    spec = importlib.util.spec_from_file_location(f"_thdpack_tests_{name}", ROOT / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def megatron_site() -> tuple[Path | None, str | None]:
    """``(path to add to PYTHONPATH or None for an installed megatron-core, why not)``. Never downloads."""
    try:
        if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
            return None, None
    except Exception:  # a broken megatron install: try the tests' copy
        pass
    try:
        site = _tests_module("megatron_env").CACHE / "site"
    except Exception as exc:
        return None, f"megatron-core is not installed and tests/megatron_env.py cannot be read ({exc})"
    if (site / "megatron" / "core" / "ssm" / "gated_delta_net").is_dir():
        return site, None
    return None, (f"megatron-core is not installed, and tests/megatron_env.py's unpacked wheel is not at {site} "
                  "(run tests/test_megatron_gdn.py where pip reaches a package index, or set THDPACK_CACHE)")


def _missing() -> str | None:
    """Why the check cannot run here, or None."""
    try:
        import torch
    except Exception as exc:
        return f"torch not importable ({exc})"
    if not torch.cuda.is_available():
        return "no CUDA device (flash-linear-attention's kernels are Triton/CUDA)"
    for module in ("fla.ops.gated_delta_rule", "fla.modules.convolution", "fla.modules.l2norm"):
        try:
            found = importlib.util.find_spec(module) is not None
        except Exception:
            found = False
        if not found:
            return f"flash-linear-attention not importable (no {module}): pip install flash-linear-attention"
    return megatron_site()[1]


def megatron_gdn_check(tokens: int = 2048, timeout: float = 600) -> dict:
    """megatron-core's GDN layer, bf16 on CUDA, on a pack of about ``tokens`` tokens vs each sample alone.

    Returns ``{"max_abs_diff", "tolerance", "cases", "megatron_core"}``, ``{"skipped": why}`` where CUDA,
    flash-linear-attention or megatron-core is missing, or ``{"error": ...}`` when the run failed. Never raises."""
    try:
        why = _missing()
        if why:
            return {"skipped": why}
        site, _ = megatron_site()
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        if site is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--tokens", str(tokens)],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        lines = done.stdout.strip().splitlines()
        if done.returncode or not lines:
            return {"error": f"exit {done.returncode}: {done.stderr.strip()[-3000:]}"}
        return json.loads(lines[-1])
    except Exception as exc:  # the caller gets a result whatever happens
        return {"error": f"{type(exc).__name__}: {exc}"}


# ---- in the subprocess (megatron-core importable) ----

def stub_megatron_packages() -> None:
    """The package ``__init__`` files of megatron.core & co. stubbed, as tests/megatron_run.py does."""
    _tests_module("megatron_run")._stub_packages()


class _Linear:
    """What ``build_module`` makes of ``GatedDeltaNetSubmodules.in_proj`` / ``out_proj``: a linear layer
    returning ``(output, bias)`` like megatron's Column/RowParallelLinear at tensor-parallel size 1."""

    def __new__(cls, input_size, output_size, *, bias=False, **_megatron_kwargs):
        import torch

        class Linear(torch.nn.Linear):
            def forward(self, x):
                return super().forward(x), None

        return Linear(input_size, output_size, bias=bias)


def one_rank_group():
    """A real one-rank ``torch.distributed`` gloo group: the default group when none exists, else this
    rank's own (tensor parallel size 1)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    return dist.new_subgroups(1)[0]


def gdn_layer(device, dtype, seed: int = 0, cp_group=None, *, hidden: int = HIDDEN, head_dim: int = HEAD_DIM):
    """megatron-core's ``GatedDeltaNet`` (tiny config, tensor parallel size 1; context parallel over
    ``cp_group``, a one-rank group when None), on ``device``, every parameter from ``seed``."""
    import torch
    import torch.nn.functional as F

    import megatron.core.parallel_state  # noqa: F401  (first: megatron.core.utils <-> parallel_state import cycle)
    from megatron.core.jit import disable_jit_fuser

    disable_jit_fuser()  # no torch.compile of the fused helpers (applied when gdn's module is first imported)
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    tp = one_rank_group()
    cp = tp if cp_group is None else cp_group
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, linear_conv_kernel_dim=CONV_KERNEL,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_num_key_heads=KEY_HEADS,
        linear_num_value_heads=VALUE_HEADS, normalization="RMSNorm", layernorm_epsilon=1e-6, activation_func=F.silu,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, perform_initialization=False,
        context_parallel_size=cp.size(),
    )
    submodules = GatedDeltaNetSubmodules(in_proj=_Linear, out_norm=WrappedTorchNorm, out_proj=_Linear)
    layer = GatedDeltaNet(config, submodules, layer_number=1, pg_collection=ProcessGroupCollection(tp=tp, cp=cp))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # perform_initialization=False leaves dt_bias / A_log empty: set every parameter
        for name, p in sorted(layer.named_parameters()):
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "conv1d" in name else 0.05))
    return layer.to(device=device, dtype=dtype).eval()


def embed(ids, device, dtype, seed: int = 1, hidden: int = HIDDEN):
    """``[s, 1, hidden]`` hidden states (megatron's sbhd) of token ids: a fixed random table."""
    import torch

    table = torch.randn(VOCAB, hidden, generator=torch.Generator().manual_seed(seed))
    return table[ids.long().cpu() % VOCAB].unsqueeze(1).to(device=device, dtype=dtype)


def pack_vs_alone(layer, batch, dtype) -> float:
    """The largest difference, over the real tokens, between ``layer`` on the pack (``to_packed_seq_params()``)
    and on each sample alone (no ``packed_seq_params``: one sequence)."""
    import torch

    from thdpack.integrations import to_packed_seq_params

    device = next(layer.parameters()).device
    params = to_packed_seq_params(batch.to(device))
    hidden = layer.hidden_size
    with torch.no_grad():
        packed, _ = layer(embed(batch.input_ids, device, dtype, hidden=hidden), None, packed_seq_params=params)
        diff = 0.0
        for a, s in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.seq_lens.tolist()):
            alone, _ = layer(embed(batch.input_ids[a:a + s], device, dtype, hidden=hidden), None)
            diff = max(diff, float((packed[a:a + s].float() - alone.float()).abs().max()))
    return diff


def layouts(lengths: list[int]) -> dict:
    """The layouts checked: none, alignment padding, static shapes (3 spare sequences, the stream to 64s)."""
    pad_to = -(-(sum(-(-n // 8) * 8 for n in lengths) + 1) // 64) * 64  # a tail after the last sample
    return {"unpadded": {}, "pad_multiple_8": {"pad_multiple": 8},
            "static_shapes": {"pad_multiple": 8, "max_num_seqs": len(lengths) + 3, "pad_to": pad_to}}


def _child(tokens: int, device: str = "cuda", dtype: str = "bfloat16") -> dict:
    """In the subprocess: the layer on each layout's pack vs its samples alone (megatron-core importable)."""
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT))  # thdpack from this checkout
    if "megatron.core" not in sys.modules:
        stub_megatron_packages()
    import megatron.core.package_info as info

    import thdpack

    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < tokens * 0.9:
        lengths.append(int(min(tokens // 3, max(2, rng.lognormal(np.log(tokens / 12), 0.9)))))
    lengths.append(1)
    samples = [{"input_ids": rng.integers(3, VOCAB, n).tolist()} for n in lengths]
    dtype = getattr(torch, dtype)
    layer = gdn_layer(torch.device(device), dtype)
    cases = {}
    for name, layout in layouts(lengths).items():
        batch = thdpack.build_thd_batch(samples, **layout)
        cases[name] = {"max_abs_diff": pack_vs_alone(layer, batch, dtype), "tokens": int(batch.input_ids.numel()),
                       "samples": len(lengths)}
    return {"max_abs_diff": max(c["max_abs_diff"] for c in cases.values()), "tolerance": TOLERANCE, "cases": cases,
            "megatron_core": info.__version__}


if __name__ == "__main__":
    if "--child" in sys.argv:
        n = int(sys.argv[sys.argv.index("--tokens") + 1])
        print(json.dumps(_child(n)))
    else:
        print(json.dumps(megatron_gdn_check()))
