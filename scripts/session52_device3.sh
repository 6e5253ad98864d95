#!/bin/bash
# Session 52's last device call, trimmed to what little device time was left: the new tests on CUDA, then the
# GNN bench one case at a time (largest first), so that each finished case's table comes back.
export PYTHONPATH=.:tests:scripts TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/targets/gpu/test_scatter_stores.py tests/frontend/test_capture.py \
  -k "stores or scatter or operator_methods or augmented or torch_geometric or message or degrees or bfloat16 or positions" \
  2>&1 | grep -E "^E  |FAILED|passed|failed" | head -20
for case in gcn:arxiv-synthetic graphsage:arxiv-synthetic gcn:cora; do
  timeout 200 python3 -m stitchflow.bench.gnn --cases $case --out $OUT/${case/:/_} --markdown $OUT/${case/:/_}.md 2>&1 | tail -2
  grep "^| $case" $OUT/${case/:/_}.md
done
