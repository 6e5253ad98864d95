"""The pruning heuristic of design-space exploration (FuseFlow): drop a configuration before
evaluating it when its static estimate does far more work or traffic than the unfused one.

PRUNE_FACTOR = 4: the largest speedup FuseFlow reports from fusion is 3.9x (GraphSAGE on
ogbn-mag), gained by removing intermediate traffic and pipelining operators; a configuration
that does more than 4x the unfused FLOPs or moves more than 4x the unfused bytes would need a
larger gain than any observed just to break even. Fully fused GCN (8.5-18.6x the FLOPs,
recomputation) is the case this is for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence

from .cost import Estimate

PRUNE_FACTOR = 4.0


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


def prune_reason(est: Estimate, base: Estimate, factor: float = PRUNE_FACTOR) -> str | None:
    """Why `est` is pruned against the unfused estimate `base`, or None to keep it."""
    why = []
    if base.flops > 0 and est.flops > factor * base.flops:
        extra = f" ({est.recomputed_flops:.3g} recomputed)" if est.recomputed_flops else ""
        why.append(f"{est.flops / base.flops:.1f}x the unfused FLOPs{extra}")
    if base.bytes > 0 and est.bytes > factor * base.bytes:
        why.append(f"{est.bytes / base.bytes:.1f}x the unfused bytes")
    if not why:
        return None
    return " and ".join(why) + f" > {factor:g}x"


def prune(configs: Sequence[Hashable], estimates: Mapping[Hashable, Estimate],
          factor: float = PRUNE_FACTOR, baseline: Estimate | Callable[[Hashable], Estimate] | None = None,
          ) -> PruneResult:
    """Split `configs` into kept and pruned. `baseline` is the unfused estimate (or a function
    giving the unfused estimate to compare each configuration with, e.g. under the same
    options); by default the configuration named "unfused"."""
    if baseline is None:
        baseline = estimates["unfused"]
    base_of = baseline if callable(baseline) else (lambda _c: baseline)
    kept, pruned = [], []
    for c in configs:
        why = prune_reason(estimates[c], base_of(c), factor)
        (pruned.append(Pruned(c, why)) if why else kept.append(c))
    return PruneResult(tuple(kept), tuple(pruned), factor)
