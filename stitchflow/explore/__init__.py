"""Design-space exploration (FuseFlow): granularities x dataflow orders x parallel factors x block
sizes x hoisting, pruned by the static estimate, survivors evaluated in parallel.

    result = explore("gcn", build, dataset="cora", orders=[None, 0, 1], par=[{}, {0: 4}], blocks=[None, 16])

`build(app, size=, dataset=, block=, seed=)` returns (model, example inputs): the sweep knows no
models, so the caller hands it the one it explores (`stitchflow.apps.explore.explore` hands it the
app zoo's; `stitchflow explore` on the command line goes through that). Workers rebuild the model
from the same key, so `build` must be a module-level function (it is pickled by name). The sweep
sits above the planner (whose plans and static model it prunes with) and `stitchflow.compile` (with
which it builds and simulates each survivor).

Granularities: unfused, per layer, full, the planner's candidate plans ("ilp hoisted #k" and
"ilp streamed #k": the k best plans of the integer program under the static model with and
without hoisting, auto.auto_candidates), and for GCN the ablations of spec/workloads.md. Knobs
reach the target as `options` = {"order": k, "par": {level: lanes}, "block": b, "hoist": False};
order None lets the scheduler take the best legal order of each region (by its estimated
critical path), order "tokens" the one with the fewest estimated tokens (FuseFlow's estimate). The target hoists by
default; the granularities in `streamed` (default: full) are also run with hoist=False, FuseFlow's
fully streamed recomputation ("full streamed"), where the static estimate differs.

"auto" is the fastest candidate plan by the evaluation (FlashFuser's "analytical model, then
measure the best few"): one row per combination of the other knobs, naming the plan it is.
Each distinct (partition, options) is evaluated once, whichever rows share it.

Evaluation is pluggable: when the target is loadable and `Program` has `simulate`, each survivor
is compiled and simulated (cycles); until then the static estimate of cost.py is the value, and
the table says so ("evaluated by" static|simulator). Workers run through a concurrent.futures
executor: local processes by default, a Dask cluster when given "tcp://host:port".
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..ir.errors import StitchflowError
from ..planner.auto import auto_candidates
from ..planner.cost import Estimate, model_for
from ..planner.granularity import granularities, partition_key
from ..planner.prune import COST_FACTOR, PRUNE_FACTOR, prune
from .report import Row, write_csv, write_json, write_plot


STANDARD = ("unfused", "per-layer", "full")


@dataclass(frozen=True)
class AppKey:
    """What a worker needs to rebuild the app: it is cheaper to capture again than to ship it.
    `build(app, size=, dataset=, block=, seed=)` returns (model, example inputs)."""

    app: str
    size: str | None
    dataset: str | None = None
    block: int | None = None
    seed: int = 0
    build: Callable | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return f"{self.app}[{self.size}{', ' + self.dataset if self.dataset else ''}]"


@dataclass(frozen=True)
class Config:
    granularity: str
    groups: tuple[tuple[str, ...], ...]
    order: int | str | None = None  # None: the target's default order; "tokens": its token-estimated one
    par: tuple[tuple[int, int], ...] = ()
    block: int | None = None
    hoist: bool = True

    def __str__(self) -> str:
        par = "x".join(str(w) for _, w in self.par) or "1"
        order = "best" if self.order is None else str(self.order)
        return f"{self.name} o={order} p={par} b={self.block or '-'}"

    @property
    def name(self) -> str:
        return self.granularity + ("" if self.hoist else " streamed")

    @property
    def knobs(self) -> tuple:
        """Everything but the partition: configurations to compare with each other."""
        return self.order, self.par, self.block

    @property
    def options(self) -> dict:
        out: dict = {"par": dict(self.par)}
        if self.order == "tokens":
            out["order_by"] = "tokens"
        elif self.order is not None:
            out["order"] = self.order
        if self.block:
            out["block"] = self.block
        if not self.hoist:
            out["hoist"] = False
        return out

    def evaluation_key(self) -> tuple:
        """Configurations with equal keys compile to the same program."""
        return partition_key(self.groups), self.knobs, self.hoist


@dataclass(frozen=True)
class ExploreResult:
    app: str
    dataset: str | None
    target: str
    rows: tuple[Row, ...]
    files: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        kept = sum(r.status == "ok" for r in self.rows)
        return f"explore {self.app} ({self.dataset or 'default'}) on {self.target}: {kept} evaluated, {len(self.rows) - kept} pruned"

    def table(self) -> list[tuple]:
        """The rows as comparable tuples (what two executors must agree on)."""
        return [r.key() for r in self.rows]


@functools.lru_cache(maxsize=4)
def load_app(key: AppKey):
    """(captured program, example inputs, densities) of an app, once per process."""
    from ..program import capture_model

    if key.build is None:
        raise StitchflowError(f"exploring {key.app!r} needs build=, a function that makes its model and inputs "
                              f"(stitchflow.apps.explore.explore passes the app zoo's)")
    model, inputs = key.build(key.app, size=key.size, dataset=key.dataset, block=key.block, seed=key.seed)
    captured = capture_model(model, inputs, None)
    values = dict(captured.param_values)
    values.update(zip(captured.graph.inputs, [x for x in inputs if hasattr(x, "layout")]))
    return captured, inputs, values


def _densities(key: AppKey, blocks: Sequence[int | None]):
    from ..planner.stats import measure

    captured, _, values = load_app(key)
    return measure(captured.graph, values, blocks=tuple(b for b in blocks if b))


def static_estimate(key: AppKey, target: str, config: Config, blocks=()) -> tuple[Estimate, float]:
    """(summed estimate, cost) of a configuration under the target's static model."""
    total, cost, _ = region_estimates(key, target, config, blocks)
    return total, cost


def region_estimates(key: AppKey, target: str, config: Config, blocks=()):
    """(summed estimate, cost, [(model, region estimates)]) under the target's static model."""
    captured, _, _ = load_app(key)
    model = model_for(target, _densities(key, tuple(blocks) or (config.block,)))
    ests = [model.estimate(captured.graph, g, config.options) for g in config.groups]
    total = ests[0]
    for e in ests[1:]:
        total = total + e
    return total, model.total(ests), (model, ests)


def calibration_note(static: dict, value_of: dict) -> str | None:
    """Fit the static model's weights to the simulated cycles (relative least squares, cost.calibrate)
    and say how far the model was from the simulator before and after: the model ranks plans
    for the integer program; this is how much to trust it on this app."""
    sims = [c for c, v in value_of.items() if v.get("by") == "simulator" and v["value"] > 0]
    if len(sims) < 2:
        return None
    model = static[sims[0]][2][0]
    samples = [(static[c][2][1], value_of[c]["value"]) for c in sims]
    fitted = model.calibrate(samples, relative=True)

    def error(m) -> float:
        return float(sorted(abs(m.total(e) / v - 1.0) for e, v in samples)[len(samples) // 2])

    weights = ", ".join(f"{n} {w:.3g}" for n, w in zip(model.feature_names, fitted.weights))
    return (f"static model calibrated on {len(samples)} simulated configurations: weights {weights}; median "
            f"|static/simulated - 1| {error(model):.0%} before, {error(fitted):.0%} after")


def simulator_available(target: str) -> bool:
    """The dataflow simulator (issue 4) plugs in here: a loadable target and Program.simulate."""
    from ..program import Program
    from ..targets import get_target

    if target != "dataflow" or not hasattr(Program, "simulate"):
        return False
    try:
        return getattr(get_target(target), "simulate", None) is not None
    except StitchflowError:
        return False


def evaluate(key: AppKey, target: str, config: Config, blocks=()) -> dict:
    """Evaluate one configuration (runs in a worker): simulated cycles when the simulator
    exists, else the static estimate."""
    est, cost = static_estimate(key, target, config, blocks)
    result = {"flops": est.flops, "bytes": est.bytes, "recomputed": est.recomputed_flops,
              "regions": est.regions, "value": cost, "by": "static"}
    if simulator_available(target):
        from ..program import Program

        captured, inputs, values = load_app(key)
        regions = [list(g) for g in config.groups]
        from ..planner.regions import ordered_regions

        prog = Program(captured, ordered_regions(captured.graph, regions), target, regions, config.options,
                       examples=values)
        sim = prog.simulate(*inputs)
        result.update(value=float(getattr(sim, "cycles", sim)), by="simulator")
    return result


def _executor(executor):
    """(executor, owned): a given Executor, a Dask client's executor for "tcp://...", or local
    processes (spawned: forking a process that has run torch ops can deadlock its thread pools)."""
    if isinstance(executor, Executor):
        return executor, False
    if isinstance(executor, str) and executor.startswith(("tcp://", "tls://", "ucx://")):
        try:
            from dask.distributed import Client
        except ImportError as err:
            raise StitchflowError(f"--executor {executor} needs dask.distributed: pip install 'dask[distributed]' ({err})")
        client = Client(executor)
        return _DaskExecutor(client), True
    if executor not in (None, "local", "processes"):
        raise StitchflowError(f"unknown executor {executor!r}: use local processes (default) or tcp://host:port")
    import multiprocessing

    workers = max(1, min(4, os.cpu_count() or 1))
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")), True


class _DaskExecutor:
    """A Dask client's concurrent.futures executor that closes the client with it."""

    def __init__(self, client):
        self.client, self.inner = client, client.get_executor()

    def submit(self, fn, *args, **kwargs):
        return self.inner.submit(fn, *args, **kwargs)

    def shutdown(self, wait=True):
        self.inner.shutdown(wait=wait)
        self.client.close()


def _run(executor, tasks, progress: bool) -> list[dict]:
    from rich.progress import Progress

    futures = {executor.submit(evaluate, *t): k for k, t in enumerate(tasks)}
    results: list = [None] * len(tasks)
    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task("evaluating configurations", total=len(tasks))
        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            bar.advance(job)
    return results


def configurations(key: AppKey, target: str, orders, par, blocks, streamed=("full",)):
    """(configurations, notes, partitions of the planner's candidate plans)."""
    captured, _, values = load_app(key)
    graph = captured.graph
    candidates = auto_candidates(graph, target, values)
    grans, notes = granularities(key.app, graph, lambda: [(label, p.groups) for label, p in candidates])
    configs = [Config(name, tuple(map(tuple, groups)), o, tuple(sorted(dict(p).items())), b, hoist)
               for name, groups in grans for hoist in ((True, False) if name in streamed else (True,))
               for o in orders for p in par for b in blocks]
    return configs, notes, {partition_key(p.groups) for _, p in candidates}


def _refusals(key: AppKey, target: str, configs: list[Config]) -> dict[Config, str]:
    """Configurations with a region the target cannot run, with the target's reason."""
    from ..planner.candidates import Legality

    captured, _, _ = load_app(key)
    legality = Legality(target)
    out = {}
    for c in configs:
        for g in c.groups:
            why = legality.check(captured.graph, g)
            if why:
                out[c] = f"target {target} refuses {{{', '.join(g[:3])}{', ...' if len(g) > 3 else ''}}}: {why}"
                break
    return out


def explore(app: str, build: Callable, dataset: str | None = None, target: str = "dataflow", orders: Sequence = (None,),
            par: Sequence[Mapping] = ({},), blocks: Sequence = (None,), executor=None,
            out_dir: str | Path | None = "explore_out", size: str | None = None, seed: int = 0,
            factor: float = PRUNE_FACTOR, progress: bool = True, app_block: int | None = None,
            streamed: Sequence[str] = ("full",), cost_factor: float = COST_FACTOR) -> ExploreResult:
    """Sweep the design space of `app`, whose model and inputs `build` makes (see the module
    docstring); write CSV, JSON and a PNG of the speedup over unfused to `out_dir` (None: write
    nothing)."""
    key = AppKey(app, size, dataset, app_block, seed, build)
    configs, notes, auto_keys = configurations(key, target, list(orders), list(par), list(blocks), tuple(streamed))
    refused = _refusals(key, target, configs)
    configs = [c for c in configs if c not in refused]
    static = {c: region_estimates(key, target, c, blocks) for c in configs}
    configs, same = _drop_same_streamed(configs, static)
    notes += same
    ests, costs = {c: static[c][0] for c in configs}, {c: static[c][1] for c in configs}
    unfused = {c.knobs: c for c in configs if c.granularity == "unfused"}
    result = prune(configs, ests, factor, baseline=lambda c: unfused[c.knobs], costs=costs, cost_factor=cost_factor)
    distinct: dict = {}
    for c in result.kept:
        distinct.setdefault(c.evaluation_key(), c)
    pool, owned = _executor(executor)
    try:
        values = _run(pool, [(key, target, c, tuple(blocks)) for c in distinct.values()], progress)
    finally:
        if owned:
            pool.shutdown()
    measured = dict(zip(distinct, values))
    value_of = {c: measured[c.evaluation_key()] for c in result.kept}
    autos, auto_notes = _auto(configs, result.kept, value_of, auto_keys)
    notes += auto_notes
    calibrated = calibration_note(static, value_of)
    notes += [calibrated] if calibrated else []
    rows = _rows(configs, ests, value_of, {p.config: p.reason for p in result.pruned}, autos)
    rows += [Row(str(c), c.name, len(c.groups), "best" if c.order is None else str(c.order),
                 "x".join(str(w) for _, w in c.par) or "1", c.block or 0, 0.0, 0.0, 0.0, None, None, "-",
                 "refused", why) for c, why in refused.items()]
    files = _write(rows, out_dir, f"{app}-{dataset or size or 'default'}-{target}") if out_dir else ()
    return ExploreResult(app, dataset, target, tuple(rows), tuple(files), tuple(notes))


def _drop_same_streamed(configs, static) -> tuple[list[Config], list[str]]:
    """Streamed variants whose static estimate equals the hoisted one (nothing to hoist)."""
    hoisted = {(c.granularity, c.knobs): c for c in configs if c.hoist}
    kept, notes = [], []
    for c in configs:
        twin = None if c.hoist else hoisted.get((c.granularity, c.knobs))
        if twin is not None and static[c][0].flops == static[twin][0].flops and static[c][0].bytes == static[twin][0].bytes:
            notes.append(f"{c}: same static estimate as with hoisting (nothing to hoist), not run")
            continue
        kept.append(c)
    return kept, list(dict.fromkeys(notes))


def _auto(configs, kept, value_of, auto_keys) -> tuple[dict, list[str]]:
    """{knobs: the fastest evaluated candidate plan}: exploration's "auto" per combination of
    the other knobs, and a note per combination saying which plan it is. The candidates are the
    planner's plans and, under these knobs, every standard granularity the exploration kept and
    evaluated anyway: the planner ranked its plans with the target's default order and lanes, and
    an explicit knob can change what a fused region costs in ways the static model misses (GCN at
    order 0 with 4 lanes: the planner's plans simulated 2.2x slower than unfused, while unfused's
    static cost was more than the model's error (auto.MODEL_MARGIN) above theirs). Like the GPU
    autotuner timing the library plan, the pick is made on measurements, at no extra simulation."""
    planned = [c for c in kept if c.hoist and partition_key(c.groups) in auto_keys]
    near = [c for c in kept if c.hoist and c.granularity in STANDARD and c not in planned and c in value_of]
    best: dict = {}
    for c in [c for c in planned + near if c in value_of]:
        if c.knobs not in best or value_of[c]["value"] < value_of[best[c.knobs]]["value"]:
            best[c.knobs] = c
    counts = {k: sum(c.knobs == k for c in planned + near) for k in best}
    notes = [f"auto o={'best' if k[0] is None else k[0]} p={'x'.join(str(w) for _, w in k[1]) or '1'} "
             f"b={k[2] or '-'}: {c.granularity}, the fastest of {counts[k]} candidate plans"
             for k, c in best.items()]
    if not best and auto_keys:
        notes.append("auto: every candidate plan was pruned or refused")
    return best, notes


def _rows(configs, ests, values: dict, pruned: dict, autos: dict) -> list[Row]:
    baseline = values.get(next(c for c in configs if c.granularity == "unfused"), {}).get("value")

    def row(c, name, config_text):
        e, v = ests[c], values.get(c)
        value = v["value"] if v else None
        speedup = baseline / value if v and value and baseline else None
        return Row(config_text, name, len(c.groups), "best" if c.order is None else str(c.order),
                   "x".join(str(w) for _, w in c.par) or "1", c.block or 0, e.flops, e.bytes,
                   e.recomputed_flops, value, speedup, v["by"] if v else "-",
                   "ok" if v else "pruned", pruned.get(c, ""))

    rows = [row(c, c.name, str(c)) for c in configs]
    at = next((k for k, c in enumerate(configs) if c.granularity not in ("unfused", "per-layer", "full")), len(rows))
    auto_rows = [row(c, "auto", f"auto = {c}") for c in autos.values()]
    return rows[:at] + auto_rows + rows[at:]


def _write(rows: list[Row], out_dir, stem: str) -> list[str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [str(write_csv(rows, out / f"{stem}.csv")), str(write_json(rows, out / f"{stem}.json")),
            str(write_plot(rows, out / f"{stem}.png", stem))]


def parse_par(text: str) -> dict:
    """Parallel factors as the dataflow target takes them, {variable: lanes}: "i=4,k=4" names
    the variables; "1" is no fork, "4" forks each region's `i` (the outermost output variable
    by the frontend's naming), "4x4" nests forks on `i` and `j`."""
    if "=" in text:
        pairs = [item.split("=") for item in text.split(",")]
        return {var.strip(): int(w) for var, w in pairs if int(w) > 1}
    widths = [int(w) for w in text.lower().split("x")]
    return {var: w for var, w in zip("ijkl", widths) if w > 1}
