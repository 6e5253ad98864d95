"""Design-space exploration of the app zoo: the sweep of `stitchflow.explore` over a model of APPS,
which workers rebuild from its key with `build_app`.

    result = explore("gcn", dataset="cora", orders=[None, 0, 1], par=[{}, {"i": 4}], blocks=[None, 16])
"""

from __future__ import annotations

from .. import explore as sweep
from ..ir.errors import StitchflowError
from . import APPS, default_size


def build_app(app: str, *, size: str | None, dataset: str | None, block: int | None, seed: int):
    """(model, example inputs) of an app of the zoo. Module-level, so that worker processes and
    Dask workers unpickle it by name."""
    if app not in APPS:
        raise StitchflowError(f"unknown app {app!r}; known: {', '.join(sorted(APPS))}")
    return APPS[app].build(size=default_size(app, size, dataset), dataset=dataset, block=block, seed=seed)


def explore(app: str, dataset: str | None = None, size: str | None = None, **options) -> sweep.ExploreResult:
    """`stitchflow.explore.explore` over the zoo's `app` (options: its keyword arguments)."""
    return sweep.explore(app, build_app, dataset=dataset, size=default_size(app, size, dataset), **options)
