"""CSR × dense products on the device: every kernel config against float64 on a power-law graph, and the GNN
apps on the gpu target (the step times the kernel against cuSPARSE) against eager. Needs a CUDA GPU."""

import pytest
import torch

import stitchflow
from stitchflow.targets.gpu.spmm import CONFIGS, SpmmStep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("features", [7, 16, 128])
def test_every_config_on_a_power_law_graph(config, features):
    g = torch.Generator().manual_seed(0)
    n = 5000
    degree = (torch.rand(n, generator=g) ** -1.5).clamp(max=2000).long()  # a few rows thousands long
    rows = torch.repeat_interleave(torch.arange(n), degree)
    cols = torch.randint(0, n, (rows.numel(),), generator=g)
    s = torch.sparse_coo_tensor(torch.stack([rows, cols]), torch.rand(rows.numel(), generator=g), (n, n))
    s = s.coalesce().to_sparse_csr().cuda()
    d = torch.randn(n, features, device="cuda")
    out = config(s, d, torch.float32)
    ref = s.to_dense().double() @ d.double()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.parametrize("app", ["gcn", "graphsage"])
def test_gnn_apps(app):
    from stitchflow.apps import APPS

    model, (a, x) = APPS[app].build(size="default", dataset="cora")
    model, a, x = model.cuda(), a.cuda(), x.cuda()
    prog = stitchflow.compile(model, (a, x), target="gpu", fusion="auto")
    assert [s for c in prog.compiled for s in c.steps if isinstance(s, SpmmStep)]
    with torch.no_grad():
        out, ref = prog(a, x), model(a, x)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4
