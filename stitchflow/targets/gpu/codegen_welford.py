"""A centred variance that rides on its mean through a chunk loop (codegen's PartKernel mixes this in).

A row too long for one chunk loops over it once per stage: the mean's stage reads the row, then the variance's
stage reads it again to centre it on the finished mean, then the outputs' stage a third time (group norm's
65536-element groups: three passes, the second and third from L2). Here the variance joins its mean's loop:
every lane keeps Welford's running mean and centred sum of squares of the elements it has seen, and after the
loop the lanes combine (Chan, Golub, LeVeque): the mean is the count-weighted mean of the lanes' means, the
centred sum is the lanes' sums plus their means' spread about it. One pass fewer, and as stable as the two-pass
form (each update centres on a running mean, never on zero).

Taken where a part runs in one launch with one program per row (a split row meets at a barrier instead,
codegen_split), prefetched chunk loops included; `centred_variances` says which reductions qualify. A row split
over programs that meet in memory between launches (a phased split) takes it too: each program keeps the
running sums over its piece and publishes the piece's sum and its centred sum of squares about the piece's own
mean, which the next launch combines with the pieces' spread (codegen_split._combine_variance). The variance's
launch goes: ResNet-18's batch norms at 14x14 and 7x7 ran three launches of 4 + 7 + 8.5 µs where Inductor's
Welford took 9.4 µs in all (H100).
"""

from __future__ import annotations

from .codegen_split import _scaled, centred_variances
from .mapping import n_chunks


def phased_riding(graph, plan, cfg) -> dict[str, tuple[str, float]]:
    """variance -> (its mean, factor) for the variances a phased split folds into their mean's launch:
    one (one running count per kernel), pieces looped in chunks (a piece in one chunk keeps its stage)."""
    if not (cfg.split > 1 and plan.reductions and not cfg.coop) or n_chunks(plan, cfg) == 1:
        return {}
    found = centred_variances(graph, plan)
    return found if len(found) == 1 else {}


def phase_stages(graph, plan, cfg, riding: dict | None = None) -> list[int]:
    """The stages that a phased split's launches run, one each: those with a reduction of their own
    (a riding variance's is its mean's) and the last; [final stage] for a part in one launch.
    `riding`: phased_riding's answer, where the caller has it."""
    if not (cfg.split > 1 and plan.reductions and not cfg.coop):
        return [plan.final_stage]
    riding = phased_riding(graph, plan, cfg) if riding is None else riding
    busy = {plan.stage[riding[r.name][0] if r.name in riding else r.name] for r in plan.reductions}
    return [s for s in range(plan.final_stage + 1) if s in busy or s == plan.final_stage]


class WelfordStitching:
    """Needs from its host: src, graph, plan, cfg, split, single_chunk, need_mask_l, body, reduction_phases."""

    def riding_variances(self) -> dict[str, tuple[str, float]]:
        """variance -> (its mean, factor) for the variances this kernel folds into their mean's chunk loop."""
        if self.single_chunk or self.split != 1 or self.reduction_phases:
            return {}
        found = centred_variances(self.graph, self.plan)
        return found if len(found) == 1 else {}  # one running count (`wk`) per kernel

    def welford_init(self) -> tuple[str, str]:
        shape = f"[{self.cfg.BP}, {self.cfg.BL}]"
        mean = self.src.let(f"tl.zeros({shape}, tl.float32)", "wm")
        m2 = self.src.let(f"tl.zeros({shape}, tl.float32)", "wq")
        self.src.emit("wk = 0.0")  # full chunks seen: every lane's count until the masked last chunk
        return mean, m2

    def welford_step(self, mean_node: str, acc: tuple[str, str], scope) -> None:
        """One chunk: each lane's count, running mean and centred sum of squares advance by its element."""
        e, (wm, wq) = self.src.emit, acc
        x = self._welford_element(mean_node, scope)
        d = self.src.let(f"{x} - {wm}", "d")
        if self.need_mask_l:  # the last, partial chunk: lanes past the end keep what they have
            n = self.src.let("tl.where(mask_l, wk + 1.0, 1.0)", "n")
            e(f"{wm} = tl.where(mask_l, {wm} + {d} / {n}, {wm})")
            e(f"{wq} = tl.where(mask_l, {wq} + {d} * ({x} - {wm}), {wq})")
        else:
            e("wk = wk + 1.0")
            r = self.src.let("1.0 / wk", "rk")
            e(f"{wm} = {wm} + {d} * {r}")
            e(f"{wq} = {wq} + {d} * ({x} - {wm})")

    def welford_piece(self, mean_node: str, factor: float, acc: tuple[str, str]) -> tuple[str, str]:
        """(the mean's partial, the variance's partial) of this program's piece of a phased split: the
        piece's sum (times the mean's 1/n) and its centred sum of squares about its own mean (times the
        variance's factor), as codegen_split._combine_variance takes them."""
        wm, wq = acc
        lanes = f"tl.arange(0, {self.cfg.BL})[None, :]"
        count = self.src.let(f"wk + tl.where({lanes} < (hi - lo) % {self.cfg.BL}, 1.0, 0.0)" if self.need_mask_l
                             else f"tl.full([1, {self.cfg.BL}], 0.0, tl.float32) + wk", "n")
        size = self.src.let("tl.maximum(hi - lo, 1).to(tl.float32)", "n")
        mean = self.src.let(f"tl.sum({count} * {wm}, axis=1, keep_dims=True) / {size}", "mu")
        spread = self.src.let(f"tl.sum({wq} + {count} * ({wm} - {mean}) * ({wm} - {mean}), axis=1, keep_dims=True)",
                              "r")
        _, scale = _scaled(self.graph.node_of[mean_node].body)
        return (self.src.let(f"{mean} * {size} * {scale!r}", "r"), self.src.let(f"{spread} * {factor!r}", "r"))

    def welford_total(self, mean_node: str, factor: float, acc: tuple[str, str], tail: str | None) -> tuple[str, str]:
        """(mean's value, variance's value) per row from the lanes'. `tail`: the elements of the masked last
        chunk (lanes below it saw one element more), or None."""
        wm, wq = acc
        lanes = f"tl.arange(0, {self.cfg.BL})[None, :]"
        count = self.src.let(f"wk + tl.where({lanes} < {tail}, 1.0, 0.0)" if tail
                             else f"tl.full([1, {self.cfg.BL}], 0.0, tl.float32) + wk", "n")
        total = self.plan.L_total
        mean = self.src.let(f"tl.sum({count} * {wm}, axis=1, keep_dims=True) / {total}", "mu")
        spread = self.src.let(f"tl.sum({wq} + {count} * ({wm} - {mean}) * ({wm} - {mean}), axis=1, keep_dims=True)",
                              "r")
        _, scale = _scaled(self.graph.node_of[mean_node].body)
        return (self.src.let(f"{mean} * {scale * total!r}", "r"), self.src.let(f"{spread} * {factor!r}", "r"))

    def _welford_element(self, mean_node: str, scope) -> str:
        """The element the mean sums (its body without the 1/n), in float32 over the chunk's tile."""
        node = self.graph.node_of[mean_node]
        inner, _ = _scaled(node.body)
        self.body.summing = True
        try:
            v = self.body.expr(inner, node, scope)
        finally:
            self.body.summing = False
        code = f"{v.code}.to(tl.float32)"
        if v.deps != frozenset({"p", "l"}):
            code = f"tl.broadcast_to({code}, [{self.cfg.BP}, {self.cfg.BL}])"
        return self.src.let(code, "x")
