"""What a packing check found: per pack, per sample, the first module where the pack and the sample alone
differ; the losses and gradients packed vs alone; the FLOPs beside torch's count. Printed as a table
(:meth:`CheckReport.table`) or as JSON (:meth:`CheckReport.to_dict`); the last line of the table is the
first failure, or that every check holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# max |packed - alone| / max |alone| allowed per compared tensor, by the model's dtype (docs/check.md)
TOLERANCES = {"float32": 1e-4, "float64": 1e-9, "bfloat16": 3e-2, "float16": 1e-2}


@dataclass
class ModuleDiff:
    """One module's output (or a step's) for one sample: ``max |packed - alone|`` over the sample's tokens,
    ``scale`` = ``max |alone|``, ``rel`` = their ratio; ``reads``: the boundary inputs the module reads."""

    name: str
    kind: str
    reads: str
    max_diff: float
    scale: float
    rel: float
    tolerance: float
    order: int = 0  # its place in the packed forward's execution order

    @property
    def ok(self) -> bool:
        return self.rel <= self.tolerance


@dataclass
class SampleCheck:
    """One sample of a pack: its length, how many outputs were compared, the first (in execution order) that
    differs beyond the tolerance, and the largest difference seen."""

    index: int
    length: int
    compared: int
    first_failure: ModuleDiff | None
    worst: ModuleDiff | None


@dataclass
class ValueCheck:
    """A number (a loss) or a set of tensors (the gradients) packed vs alone; ``where``: the worst tensor."""

    name: str
    packed: float
    alone: float
    rel: float
    tolerance: float
    where: str = ""

    @property
    def ok(self) -> bool:
        return self.rel <= self.tolerance


@dataclass
class FlopsCheck:
    """Forward FLOPs of the packed step: thdpack's count from the real sample lengths (all of it, and its
    weight GEMMs), torch's ``FlopCounterMode`` on the same step (its GEMM ops, the rest), and thdpack's count of
    the pack as one sequence of its length (what a pack-length count claims); ``note``: why thdpack's counts
    are 0 (a config it cannot count)."""

    thdpack: int
    thdpack_gemm: int
    torch_gemm: int
    torch_other: int
    pack_length: int
    note: str = ""


@dataclass
class PackCheck:
    """One pack checked: its samples, losses, gradients and FLOPs; ``compared``: the outputs compared, ``{name:
    kind}`` in execution order; ``skipped``: those watched but not one row per token (not comparable);
    ``problems``: what the packed call lacks to keep its samples apart (an absent boundary input, positions
    that do not restart); ``error``: the model's error where it refused the packed call."""

    pack: int
    samples: list[SampleCheck] = field(default_factory=list)
    compared: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    values: list[ValueCheck] = field(default_factory=list)
    flops: FlopsCheck | None = None
    problems: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return (self.error is None and all(s.first_failure is None for s in self.samples)
                and all(v.ok for v in self.values))

    def failure(self) -> str | None:
        """One line naming this pack's first failure, None when it holds."""
        where = f"pack {self.pack}"
        lacks = f"; the call {'; '.join(self.problems)}" if self.problems else ""
        if self.error is not None:
            return f"{where}: the model refused the packed call: {self.error}{lacks}"
        firsts = [s for s in self.samples if s.first_failure is not None]
        if firsts:
            s = min(firsts, key=lambda s: s.first_failure.order)
            d = s.first_failure
            return (f"{where}, sample {s.index} ({s.length} tokens): first differs at {d.name} ({d.kind}; reads "
                    f"{d.reads}): max |packed - alone| {d.max_diff:.3g} = {d.rel:.3g} of max |alone|, tolerance "
                    f"{d.tolerance:.0e}{lacks}")
        for v in self.values:
            if not v.ok:
                return (f"{where}: {v.name} differs: packed {v.packed:.6g}, alone {v.alone:.6g} (relative "
                        f"{v.rel:.3g} > {v.tolerance:.0e}){f' at {v.where}' if v.where else ''}{lacks}")
        return None


@dataclass
class CheckReport:
    """The packs checked on one model (``model``: its class and config name, dtype, device, attention)."""

    model: str
    dtype: str
    device: str
    attention: str
    tolerance: float
    packs: list[PackCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.packs)

    def first_failure(self) -> str | None:
        """The first failing pack's line, None when every check holds."""
        return next((line for line in (p.failure() for p in self.packs) if line), None)

    def to_dict(self) -> dict:
        """The report as plain JSON values, ``ok`` and ``first_failure`` included."""
        return dict(dataclasses.asdict(self), ok=self.ok, first_failure=self.first_failure())

    def table(self) -> str:
        """The report as the ``thdpack check`` command prints it; the last line is the verdict."""
        lines = [f"model {self.model}, {self.dtype} on {self.device}, attention {self.attention}; tolerance "
                 f"{self.tolerance:.0e} (max |packed - alone| / max |alone|)",
                 f"{'pack':>4} {'samples':>7} {'tokens':>7} {'compared':>8} {'worst rel':>10}  {'worst at':<40}"
                 f" {'loss tok':>9} {'loss smp':>9} {'grads':>9}  status"]
        for p in self.packs:
            worst = max((s.worst for s in p.samples if s.worst is not None), key=lambda d: d.rel, default=None)
            values = {v.name: v for v in p.values}
            cells = [_rel(values.get(k)) for k in ("loss (token mean)", "loss (sample mean)", "gradients")]
            status = "ok" if p.ok else ("refused" if p.error else "FAIL")
            lines.append(f"{p.pack:>4} {len(p.samples):>7} {sum(s.length for s in p.samples):>7} "
                         f"{sum(s.compared for s in p.samples):>8} {_rel(worst):>10}  "
                         f"{(worst.name if worst else '-')[:40]:<40} {cells[0]:>9} {cells[1]:>9} {cells[2]:>9}  {status}")
        flops = next((p for p in self.packs if p.flops is not None), None)
        if flops is not None:
            lines.append(_flops_line(flops.pack, flops.flops))
        failure = self.first_failure()
        lines.append(f"FAIL: {failure}" if failure else f"OK: {len(self.packs)} pack(s), every check holds")
        return "\n".join(lines)


def _flops_line(pack: int, f: FlopsCheck) -> str:
    if f.note:
        return (f"FLOPs of pack {pack}'s forward: torch FlopCounterMode GEMMs {f.torch_gemm:.4g}, other ops "
                f"{f.torch_other:.4g}; {f.note}")
    return (f"FLOPs of pack {pack}'s forward: GEMMs thdpack {f.thdpack_gemm:.4g}, torch FlopCounterMode "
            f"{f.torch_gemm:.4g}; all: thdpack {f.thdpack:.4g} (torch's other ops {f.torch_other:.4g}); a "
            f"pack-length count would claim {f.pack_length:.4g}")


def _rel(check) -> str:
    return "-" if check is None else f"{check.rel:.2e}"
