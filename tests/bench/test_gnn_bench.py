"""The GNN bench's competitors and report on the CPU: torch_geometric's layers holding the app zoo's weights compute
what the app computes, and the table reports every competitor, failed ones with their reasons."""

import pytest
import torch

from stitchflow.apps import APPS
from stitchflow.bench import gnn


@pytest.mark.parametrize("app", ["gcn", "graphsage"])
@pytest.mark.parametrize("dataset", ["tiny", "karate"])
def test_torch_geometric_layers_compute_the_app(app, dataset):
    model, (a, x) = APPS[app].build(size="default", dataset=dataset)
    with torch.no_grad():
        ref, got = model(a, x), gnn.PygGNN(model)(gnn.edge_list(a), x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("app", ["gcn", "graphsage"])
def test_torch_geometric_layers_through_the_backend(app):
    """The bench's pyg+stitchflow competitor: the same torch_geometric model under torch.compile(backend=
    "stitchflow"), equal to the app, with nothing left eager."""
    from stitchflow import backend

    model, (a, x) = APPS[app].build(size="default", dataset="karate")
    with torch.no_grad():
        ref = model(a, x)
        got = torch.compile(gnn.PygGNN(model), backend="stitchflow", dynamic=False)(gnn.edge_list(a), x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert not backend.FALLBACKS, backend.fallback_report()


def test_edge_list_runs_from_column_to_row_and_refuses_weights():
    a = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]).to_sparse_csr()
    assert gnn.edge_list(a).tolist() == [[1, 2, 0], [0, 0, 2]]  # node 0 sums nodes 1 and 2; node 2 sums node 0
    with pytest.raises(ValueError, match="0/1 adjacency"):
        gnn.edge_list((a.to_dense() * 0.5).to_sparse_csr())


def test_floor_counts_the_adjacency_once_per_layer():
    a = torch.eye(4).to_sparse_csr()  # 5 row pointers and 4 columns (int64), 4 values (fp32)
    x, out = torch.zeros(4, 3), torch.zeros(4, 2)
    assert gnn.floor_bytes(a, x, out, layers=2) == 2 * (5 * 8 + 4 * 8 + 4 * 4) + 48 + 32


def test_markdown_reports_every_competitor_and_why_one_failed():
    row = {"case": "gcn:cora", "nodes": 2708, "nnz": 10556, "features": 1433, "eager us": 200.0,
           "torch_geometric us": 150.0, "stitchflow us": 100.0, "floor us": 10.0,
           "torch.compile error": "Unsupported: sparse CSR inputs", "pyg+torch.compile us": 120.0,
           "pyg+stitchflow us": 75.0}
    info = {"command": "stitchflow bench gnn", "device": "GPU", "date": "today", "torch": "2", "triton": "3",
            "copy_bw_tbs": 3.0}
    text = gnn.markdown([row, {"case": "gcn:mag-synthetic", "error": "OutOfMemoryError"}], info)
    assert ("| gcn:cora | 2708 | 10556 | 1433 | 200.0 | failed | 150.0 | 100.0 | 2.00x | 1.50x | 10.0 | 10.0 | 120.0 "
            "| 75.0 | 2.00x |") in text
    assert "gcn:cora torch.compile: Unsupported: sparse CSR inputs" in text
    assert "| gcn:mag-synthetic | failed: OutOfMemoryError |" in text


def test_main_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gnn.main(["--cases", "gcn:tiny"])
