"""The pruning heuristic of design-space exploration (FuseFlow): drop a configuration before
evaluating it when its static estimate does far more work or traffic than the unfused one.

PRUNE_FACTOR = 4: the largest speedup FuseFlow reports from fusion is 3.9x (GraphSAGE on
ogbn-mag), gained by removing intermediate traffic and pipelining operators; a configuration
that does more than 4x the unfused FLOPs or moves more than 4x the unfused bytes would need a
larger gain than any observed just to break even. Fully fused GCN (8.5-18.6x the FLOPs,
recomputation) is the case this is for.

COST_FACTOR = 1.5: a configuration whose static cost (the target model's cycles or seconds,
which weighs work and traffic together) is more than 1.5x the unfused one's is pruned too. On
the simulator the static dataflow cycles were 0.68-0.92x the simulated ones for GCN on Cora
(unfused, per-layer, full with and without hoisting; BENCHMARKS.md, "Planner"), so between two
configurations the model's ratio was off by at most 1.35x: one predicted 1.5x slower than
unfused is not expected to beat it. FuseFlow's fully fused GCN with streamed recomputation on
Cora (3.8x the FLOPs by the static estimate with the best streamed order, 2.5x the cycles;
0.29x of unfused on the simulator) and fully fused GraphSAGE (1.55x the cycles; 0.47x) are
pruned by this rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence

from .cost import Estimate

PRUNE_FACTOR = 4.0
COST_FACTOR = 1.5


@dataclass(frozen=True)
class Pruned:
    config: Hashable
    reason: str

    def __str__(self) -> str:
        return f"pruned {self.config}: {self.reason}"


@dataclass(frozen=True)
class PruneResult:
    kept: tuple
    pruned: tuple[Pruned, ...]
    factor: float

    def __str__(self) -> str:
        return f"kept {len(self.kept)}, pruned {len(self.pruned)} (factor {self.factor:g} over unfused)"


def prune_reason(est: Estimate, base: Estimate, factor: float = PRUNE_FACTOR, cost: float | None = None,
                 base_cost: float | None = None, cost_factor: float = COST_FACTOR) -> str | None:
    """Why `est` is pruned against the unfused estimate `base`, or None to keep it. With
    `cost` and `base_cost` (the static model's totals) the cost rule applies too."""
    why = []
    recomputed = f", {est.recomputed_flops:.3g} recomputed" if est.recomputed_flops else ""
    if base.flops > 0 and est.flops > factor * base.flops:
        why.append(f"{est.flops / base.flops:.1f}x the unfused FLOPs ({recomputed[2:] or 'no recomputation'}) > {factor:g}x")
    if base.bytes > 0 and est.bytes > factor * base.bytes:
        why.append(f"{est.bytes / base.bytes:.1f}x the unfused bytes > {factor:g}x")
    if why:
        return " and ".join(why)
    if cost is not None and base_cost and cost > cost_factor * base_cost:
        return (f"static estimate {cost / base_cost:.1f}x the unfused cost > {cost_factor:g}x "
                f"({est.flops / base.flops:.1f}x the FLOPs{recomputed}; {est.bytes / base.bytes:.1f}x the bytes)")
    return None


def prune(configs: Sequence[Hashable], estimates: Mapping[Hashable, Estimate],
          factor: float = PRUNE_FACTOR, baseline: Hashable | Callable[[Hashable], Hashable] | None = None,
          costs: Mapping[Hashable, float] | None = None, cost_factor: float = COST_FACTOR) -> PruneResult:
    """Split `configs` into kept and pruned. `baseline` is the unfused configuration (or a
    function giving the unfused configuration to compare each one with, e.g. under the same
    options); by default the configuration named "unfused". `costs` (static model totals per
    configuration) enable the cost rule."""
    if baseline is None:
        baseline = "unfused"
    base_of = baseline if callable(baseline) else (lambda _c: baseline)
    kept, pruned = [], []
    for c in configs:
        b = base_of(c)
        cost, base_cost = (costs[c], costs[b]) if costs is not None else (None, None)
        why = prune_reason(estimates[c], estimates[b], factor, cost, base_cost, cost_factor)
        (pruned.append(Pruned(c, why)) if why else kept.append(c))
    return PruneResult(tuple(kept), tuple(pruned), factor)
