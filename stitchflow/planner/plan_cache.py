"""Automatic plans kept on disk, so that a model compiled again (a new process, warm caches) is not planned again.

Planning is most of a warm start: with every kernel already in Triton's and stitchflow's caches, ResNet-18's
training step under torch.compile(backend="stitchflow") took 42.7 s to its first result on an H100 host, nearly all
of it the integer programs of its graphs (HiGHS proves each optimum: 7 s per forward graph), where
torch.compile's warm start took 2.0 s. A plan is fixed by what the planner reads: the graph (every field of every
node and type), the target, the densities, and the planner's and targets' code; the key hashes all four, the last
as the package's source, so that an edit to a cost model or a legality rule plans afresh.

Plans live under `$STITCHFLOW_CACHE/plans/` (default ~/.cache/stitchflow), one pickle per key, written to a
temporary file and renamed so that processes planning at once never read half a file; a file that does not
load is planned again. `STITCHFLOW_PLAN_CACHE=0` turns the cache off (the test suite does, since tests patch cost
models at run time, which the key cannot see).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import pickle
from pathlib import Path

from ..ir.paths import cache_root

log = logging.getLogger("stitchflow.planner")

FORMAT = 1  # bump when Plan's pickled form changes in a way the source hash would not show


def enabled() -> bool:
    return os.environ.get("STITCHFLOW_PLAN_CACHE", "1") not in ("", "0")


def plans_dir() -> Path:
    return cache_root() / "plans"


def canonical(value):
    """A value that repr()s the same in every process: dataclasses as (class, fields), sets sorted (string
    hashes, and so set order, differ between processes)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,) + tuple(canonical(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (tuple, list)):
        return tuple(canonical(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return ("set",) + tuple(sorted((canonical(v) for v in value), key=repr))
    if isinstance(value, dict):
        return ("dict",) + tuple(sorted(((canonical(k), canonical(v)) for k, v in value.items()), key=repr))
    return value


@functools.cache
def code_version() -> str:
    """A hash of the package's source: the planner's cost models and the targets' legality live across it."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256(str(FORMAT).encode())
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def plan_key(graph, target: str, densities) -> str:
    text = repr((code_version(), target, canonical(graph), canonical(densities)))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load(key: str):
    """The plan stored under `key`, or None (absent, or a file that does not load)."""
    path = plans_dir() / f"{key}.pkl"
    try:
        with path.open("rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as err:  # a truncated or foreign file: plan again, and overwrite it
        log.warning("stitchflow: plan cache file %s does not load (%s: %s): planning again", path,
                    type(err).__name__, err)
        return None


def store(key: str, plan) -> None:
    directory = plans_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"{key}.{os.getpid()}.tmp"
        with tmp.open("wb") as f:
            pickle.dump(plan, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, directory / f"{key}.pkl")
    except OSError as err:  # a read-only or full disk costs the next process a plan, nothing else
        log.warning("stitchflow: plan not cached in %s (%s)", directory, err)
