"""Training steps on the GPU: forward and backward of a model of the zoo (BERT-style encoder block,
Llama-style block, ...) under eager, torch.compile (Inductor, default mode) and
torch.compile(backend="stitchflow"), the latter with its backward compiled (AOTAutograd's graphs,
the default) and with the backward differentiating an eager rerun (options={"training": "recompute"}).

A step is: parameter gradients cleared, the forward, and the backward of a fixed upstream gradient
(the same random tensor for every runner, so no loss kernel is timed). Every runner's output, input
gradient and parameter gradients are checked first: in half precision against the same step in
float64 (each tensor's relative error <= 2e-2, or at most twice eager's own), in float32 against
eager (<= 1e-4); all runners in one process on the same inputs; the median of rounds timed in
turn, L2 evicted clean before each step (targets/gpu/timing.py).

    python -m stitchflow.bench.training [--apps bert,llama] [--dtype bfloat16] [--size default]
        [--out FILE] [--markdown BENCHMARKS.md] [--section "## Training steps"]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import re
import statistics
import sys
import time

import torch

from .report import app_table_rows, provenance_lines, run_apps, speedup_cell
from . import stitching
from .stitching import ROUNDS, _time_in_rounds, add_cooldown_argument
from .stitching_patterns import as_tuple, tolerance

SECTION = "## Training steps (forward + backward)"
RUNNERS = ("eager", "torch.compile", "backend=stitchflow", "backend=stitchflow recompute",
           "backend=stitchflow attention as written")


def _runner(name: str, model, options: dict | None = None):
    """`options`: more of the stitchflow backend's options (e.g. {"fusion": "full"})."""
    import stitchflow.backend  # noqa: F401  (registers the backend)

    if name == "eager":
        return model
    if name == "torch.compile":
        return torch.compile(model, dynamic=False)
    training = "recompute" if name.endswith("recompute") else "compiled"
    options = {**(options or {}), "training": training}
    if name.endswith("attention as written"):  # no rewrite of products and a softmax into torch's attention
        options["attention"] = False
    return torch.compile(model, backend="stitchflow", dynamic=False, options=options)


def _step(fn, model, inputs, upstream):
    """One training step's work: gradients cleared, forward, backward of `upstream`."""
    for p in model.parameters():
        p.grad = None
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.grad = None
    out = as_tuple(fn(*inputs))[0]
    out.backward(upstream)
    return out


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _gradients(model, inputs) -> list[torch.Tensor]:
    """The input's and every parameter's gradient (zeros where none came, so that lists align)."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad] + list(model.parameters())
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]


def _float64_step(base, inputs, upstream) -> list[torch.Tensor]:
    """The step's output and gradients (as `_gradients` lists them) with the model, its floating inputs and
    the upstream gradient in float64: the reference half-precision runners are judged against, since eager
    in bf16 is itself 10-30% off on a ResNet's stem gradients (batch norm's statistics over bf16 values)."""
    model = copy.deepcopy(base).double()
    wide = tuple(x.detach().double().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor)
                 and x.is_floating_point() else x for x in inputs)
    out = _step(model, model, wide, upstream.double())
    return [out.detach()] + _gradients(model, wide)


def _gradient_errors(got: list, want: list) -> list[float]:
    """Each tensor's error relative to its own norm, floored at 1e-3 of the largest gradient's: a
    gradient that is zero in exact arithmetic (attention's key bias: softmax ignores a shift shared
    by all keys) is rounding noise in every runner, and noise against noise is not an error."""
    floor = 1e-3 * max(torch.linalg.vector_norm(w.double()).item() for w in want[1:]) if len(want) > 1 else 0.0
    return [torch.linalg.vector_norm((g.double() - w.double())).item() /
            max(torch.linalg.vector_norm(w.double()).item(), floor if k else 0.0, 1e-30)
            for k, (g, w) in enumerate(zip(got, want))]


def training_case(app: str, dtype: torch.dtype, size: str = "default", device: str = "cuda", seed: int = 0):
    """(model, inputs, upstream): the zoo's `app` in training mode on `device` with dropout off (so that
    every runner computes the same step), its inputs with the first floating one requiring grad (the
    activations' gradient of a block inside a deeper model; a mask's is not wanted), and a fixed random
    gradient for its output."""
    from stitchflow.apps import build_model

    torch.manual_seed(seed)
    model, inputs = build_model(app, size=size, dtype=dtype)
    model = model.to(device).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    inputs = tuple(x.to(device).requires_grad_(k == 0 and x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                   for k, x in enumerate(inputs))
    with torch.no_grad():
        out = as_tuple(model(*inputs))[0]
    return model, inputs, torch.randn_like(out)


def bench_training(app: str, dtype: torch.dtype, size: str = "default", device: str = "cuda",
                   timed: bool = True, runners: tuple = RUNNERS, options: dict | None = None) -> dict:
    """One model's row: each of `runners` checked against eager (run first whatever `runners` says),
    then (`timed`) timed in rounds. `options` go to the stitchflow runners."""
    import stitchflow.backend as backend

    base, inputs, upstream = training_case(app, dtype, size, device)
    row = {"app": app, "size": size, "dtype": str(dtype).removeprefix("torch."),
           "shapes": [list(x.shape) for x in inputs if isinstance(x, torch.Tensor)],
           "parameters": sum(p.numel() for p in base.parameters())}
    exact = _float64_step(base, inputs, upstream) if dtype in (torch.bfloat16, torch.float16) else None
    steps, want, eager_errors = {}, None, None
    for name in ("eager", *(r for r in runners if r != "eager")):
        torch._dynamo.reset()
        backend.reset()
        model = copy.deepcopy(base)  # each runner its own parameters and gradients
        row[f"{name} us"] = None
        try:  # one failing competitor must not hide the others
            fn = _runner(name, model, options)
            start = time.perf_counter()  # the first step compiles (and, for stitchflow, autotunes)
            out = _step(fn, model, inputs, upstream)
            _synchronize(device)
            row[f"{name} first step s"] = round(time.perf_counter() - start, 2)
            print(f"{app}: {name}: first step {row[f'{name} first step s']} s", file=sys.stderr, flush=True)
            got = [out.detach()] + [g.clone() for g in _gradients(model, inputs)]
            if want is None:
                want = got
            errs = _gradient_errors(got, want)
            row[f"{name} err"] = max(errs)
            if exact is not None:  # half precision: judged against the step in float64, as eager is
                errs = _gradient_errors(got, exact)
                eager_errors = eager_errors or errs
                row[f"{name} err64"] = max(errs)
                bad = [k for k, (e, ee) in enumerate(zip(errs, eager_errors)) if e > max(tolerance(dtype), 2 * ee)]
                if len(got) != len(exact) or bad:
                    k = bad[0] if bad else 0
                    row[f"{name} error"] = (f"tensor {k} (0: the output) is {errs[k]:.2e} off float64's step, "
                                            f"eager's {eager_errors[k]:.2e}")
                    continue
            elif len(got) != len(want) or row[f"{name} err"] > tolerance(dtype):
                row[f"{name} error"] = f"gradients differ from eager's: relative error {max(errs):.2e}"
                continue
            if name.startswith("backend"):
                row[f"{name} eager parts"] = list(backend.FALLBACKS)
            steps[name] = lambda fn=fn, model=model: _step(fn, model, inputs, upstream)
        except Exception as exc:
            row[f"{name} error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if not timed:
        row["checked"] = sorted(steps)
        return row
    for name, times in _time_in_rounds(steps, [()]).items():
        row[f"{name} us"] = statistics.median(times)
        row[f"{name} rounds us"] = [round(t, 1) for t in times]
    ref, eager = row.get("torch.compile us"), row.get("eager us")
    for name in RUNNERS:
        t = row.get(f"{name} us")
        row[f"{name} vs compile"] = ref / t if t and ref else None
        row[f"{name} vs eager"] = eager / t if t and eager else None
    return row


def markdown(rows: list[dict], info: dict) -> str:
    head = ("| model | input | eager µs | torch.compile µs | stitchflow µs | stitchflow (recomputed backward) µs | "
            "stitchflow (attention as written) µs | stitchflow vs eager | stitchflow vs torch.compile | max rel. error | first step s (torch.compile / "
            "stitchflow) |")
    lines = [info.get("section", SECTION), "", *provenance_lines(info),
             f"{info['dtype']}, `build_model(app, size=\"{info['size']}\")` (the zoo's apps, or Hugging Face "
             "models: hf-*) in training mode; a step = gradients "
             "cleared, forward, backward of a fixed random upstream gradient (no optimizer; dropout p = 0, so that "
             "every runner computes the same step). stitchflow = "
             "torch.compile(backend=\"stitchflow\"), forward and backward graphs compiled (AOTAutograd); "
             "recomputed backward = options={\"training\": \"recompute\"}; attention as written = "
             "options={\"attention\": False} (products and a softmax not rewritten into torch's fused attention). "
             "The median of "
             f"{ROUNDS} rounds (runners in turn) of medians over steps, L2 evicted clean before each, the GPU idle "
             f"{stitching.COOLDOWN_S} s before each runner's timed steps (at the power cap its clock drops); "
             "output, input and parameter gradients checked first, in half precision against the step in float64 "
             "(each tensor's relative error ≤ 2e-2 or at most twice eager's; 'max rel. error' is against eager). The first step's wall "
             "time includes compilation (stitchflow's autotuning too).", "",
             head, "|" + "---|" * 11]
    lines += app_table_rows(rows, RUNNERS, lambda r, worst: (
        f" | {speedup_cell(r.get('backend=stitchflow vs eager'))} | "
        f"{speedup_cell(r.get('backend=stitchflow vs compile'))} | {worst:.1e} | "
        f"{r.get('torch.compile first step s', '-')} / {r.get('backend=stitchflow first step s', '-')} |"))
    for r in rows:
        parts = r.get("backend=stitchflow eager parts")
        if parts:
            lines.append(f"\n{r['app']}: ran eagerly under stitchflow: " + "; ".join(_grouped_fallbacks(parts)))
    return "\n".join(lines) + "\n"


def _grouped_fallbacks(parts: list[str]) -> list[str]:
    """The backend's fallback reasons with the node names taken out, each once with its count: a
    CNN's twenty `convolution_backward` nodes are one line, not twenty."""
    counts: dict[str, int] = {}
    for part in parts:
        reason = re.sub(r" \(\w+\):", ":", part, count=1)[:160]
        counts[reason] = counts.get(reason, 0) + 1
    return [reason if n == 1 else f"{reason} ({n} nodes)" for reason, n in counts.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="stitchflow.bench.training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--apps", default="bert,llama", help="apps of the zoo, each APP or APP:SIZE")
    parser.add_argument("--runners", default=",".join(RUNNERS),
                        help="which runners, comma-separated (eager always runs: the others are checked against it)")
    parser.add_argument("--options", default="{}", help="JSON object of options for the stitchflow runners, "
                        "e.g. '{\"fusion\": \"full\"}'")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--size", default="default")
    parser.add_argument("--out", default="", help="JSON file for the rows")
    parser.add_argument("--markdown", default="", help="file whose section (--section) is rewritten")
    parser.add_argument("--section", default=SECTION, help="the markdown section's heading")
    add_cooldown_argument(parser)
    args = parser.parse_args(argv)
    runners = tuple(r.strip() for r in args.runners.split(","))
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown:
        raise SystemExit(f"stitchflow bench training: unknown runners {unknown}; known: {', '.join(RUNNERS)}")
    if not torch.cuda.is_available():
        raise SystemExit("stitchflow bench training: needs a CUDA GPU")
    options = json.loads(args.options)
    return run_apps(args, argv, "stitchflow.bench.training",
                    functools.partial(bench_training, runners=runners, options=options), markdown)


if __name__ == "__main__":
    raise SystemExit(main())
