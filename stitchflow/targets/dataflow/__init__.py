"""The dataflow target (FuseFlow): every fusion region becomes one streaming sparse dataflow
graph of Sparse Abstract Machine primitives (spec/dataflow.md), run functionally on token
streams held as numpy arrays.

    prog = stitchflow.compile(model, inputs, target="dataflow", fusion="full",
                              options={"order": 0, "par": {"i": 4}, "block": 16})
    prog(*inputs)                                   # functional execution
    sim = prog.simulate(*inputs, channel_depth=None)  # cycles and counters (simulate.py)
    from stitchflow.targets.dataflow import describe, export
    print(describe(prog)); export(prog, "out/gcn", ("dot", "json"))

options:
  order  int (index into the legal orders of each output), a tuple or "i k j" string of
         variable names, or {output name: either}; default: the cheapest of a few candidate
         orders under a static estimate (order_by)
  par    {variable: lanes}: fork after that variable's join into round-robin lanes, merge after;
         two variables nest (4 x 4)
  block  b: sparsity blocking, values are b x b tiles over every variable whose extent b divides
         (or that can be zero-padded to a multiple of b without changing a reduction); a sum's
         blocked reduction variable is contracted in the tile ALU (b x b tile multiply)
  hoist  False: a nested reduction is computed only where its consumer's walk reaches it
         (FuseFlow's fully streamed recomputation); default True also lets the order place it
         outside enclosing consumers' loops, into an on-chip buffer. Without hoisting the loop
         nest is not the order itself (a producer's loops run inside its consumer's), so only
         orders whose streamed nest still reaches every view's levels outer-first are legal
         (order.streamed_conflict): the default is the cheapest such candidate, an int order
         indexes only those, an explicit one that is not is refused with the reason
  order_by  how the default order is chosen among the candidates: "cycles" (default) by the
         estimated critical path (order.estimate_cycles), orders that pipeline rows through
         a fused region's stages winning, then by tokens; "tokens" by the token estimate alone
"""

from __future__ import annotations

from .inspect import describe, export, to_json
from .simulate import Deadlock, SimResult, simulate
from .target import TARGET, CompiledRegion, DataflowTarget, dataflows

__all__ = ["TARGET", "DataflowTarget", "CompiledRegion", "describe", "export", "to_json", "dataflows", "simulate",
           "SimResult", "Deadlock"]
