"""Device probe: where a training step's CUDA memory goes under torch.compile(backend="stitchflow"): per
AOTAutograd graph replayed, its buffer sets (slots), what each copies in, hands over and clones, and the
allocator's reserved and allocated bytes step by step. Not a test.

    python scripts/training_memory_probe.py [--app llama] [--size default] [--dtype bfloat16] [--steps 6]
"""
import argparse

import torch

from stitchflow.bench.training import _runner, _step, training_case
from stitchflow.replay import AOT_REPLAYS


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def tensor_bytes(ts) -> int:
    return sum(t.untyped_storage().nbytes() for t in ts if isinstance(t, torch.Tensor))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--app", default="llama")
    p.add_argument("--size", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--options", default="{}")
    p.add_argument("--detail", default="", help="print plan, config and source of kernels whose name contains this")
    args = p.parse_args()
    global DETAIL
    DETAIL = args.detail
    import json

    model, inputs, upstream = training_case(args.app, getattr(torch, args.dtype), args.size)
    print("model, inputs, upstream gradient:", mib(torch.cuda.memory_allocated()))
    fn = _runner("backend=stitchflow", model, json.loads(args.options))
    for step in range(args.steps):
        torch.cuda.reset_peak_memory_stats()
        _step(fn, model, inputs, upstream)
        torch.cuda.synchronize()
        print(f"step {step}: allocated {mib(torch.cuda.memory_allocated())} "
              f"(peak {mib(torch.cuda.max_memory_allocated())}), reserved {mib(torch.cuda.memory_reserved())} "
              f"(peak {mib(torch.cuda.max_memory_reserved())})")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _step(fn, model, inputs, upstream)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60))
    kernels_by_name()
    torch.cuda.empty_cache()
    print("after empty_cache: reserved", mib(torch.cuda.memory_reserved()),
          "allocated", mib(torch.cuda.memory_allocated()))
    for r in AOT_REPLAYS:
        g = r.replay
        print(f"graph: {len(g.outputs)} outputs, {len(g.free)} free, calls {g.calls}, slots {len(g.slots)}, "
              f"plain calls {g.plain_calls}, failed {g.failed}")
        for k, slot in enumerate(g.slots):
            copied = [s for s in slot.static_inputs if s is not None]
            outs = [slot.static_env[n] for n in dict.fromkeys(g.outputs)]
            handed = [slot.static_env[n] for n in slot.handed_over]
            print(f"  slot {k}: {len(copied)} inputs copied in ({mib(tensor_bytes(copied))}), "
                  f"{len(slot.borrowed)} borrowed, outputs {mib(tensor_bytes(outs))}, handed over {len(handed)} "
                  f"({mib(tensor_bytes(handed))}), aliases {len(slot.aliases)}")
            big = sorted(copied, key=lambda t: -t.numel())[:5]
            print("    largest copied:", [(tuple(t.shape), str(t.dtype)) for t in big])
            cloned = [n for n in dict.fromkeys(g.outputs) if n not in slot.handed_over and n not in slot.aliases
                      and isinstance(slot.static_env[n], torch.Tensor)]
            shapes = [(tuple(slot.static_env[n].shape), str(slot.static_env[n].dtype)) for n in cloned]
            print("    cloned out:", shapes[:8])


DETAIL = ""  # a kernel name's part whose plan, config and source are printed (--detail)


def kernels_by_name():
    """Each generated kernel's profiler name -> its nodes and their output shapes (for reading profiles)."""
    import stitchflow.backend as backend
    from stitchflow.targets.gpu.codegen import kernel_name

    for m in backend.COMPILED:
        for prog in m.programs.values():
            for compiled in (prog._compiled if prog is not None else ()):
                for s in getattr(compiled, "steps", ()):
                    if type(s).__name__ == "GroupKernel":
                        nodes = [n for p in s.plans for n in p.nodes]
                        outs = [(o, tuple(s.graph.type_of[o].shape), str(s.graph.type_of[o].dtype)[6:])
                                for p in s.plans for o in p.outputs]
                        print(f"{m.name} {kernel_name(s.title)}: {[n.name for n in nodes]} -> {outs}")
                        if DETAIL and DETAIL in kernel_name(s.title):
                            for p in s.plans:
                                print("   plan: L", [(c, p.extents[c]) for c in p.L],
                                      "P", [(c, p.extents[c]) for c in p.P],
                                      "p_contiguous", p.p_contiguous, "transposed", p.transposed, "outputs", p.outputs)
                            print("   chosen", s.chosen, "tuned us", s.tuned_us)
                            for sig, launch in s._built.items():
                                print("   sig", sig)
                                spec = getattr(launch, "spec", None)
                                if spec is not None:
                                    print("   grid", spec.grid, "phases", spec.phases, "warps", spec.num_warps)
                                    print(spec.source)
                    else:
                        node = getattr(s, "node", None)
                        if node is not None:
                            print(f"{m.name} torch {node.name} {tuple(s.graph.type_of[node.name].shape)}")


if __name__ == "__main__":
    main()
