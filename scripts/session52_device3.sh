#!/bin/bash
# Session 52's last device call, trimmed to what little device time was left: the GNN bench one case at a time
# (largest first), so that each finished case's table comes back; then the new tests on CUDA.
export PYTHONPATH=.:tests:scripts TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}
for case in gcn:arxiv-synthetic graphsage:arxiv-synthetic; do
  timeout 150 python3 -m stitchflow.bench.gnn --cases $case --out $OUT/${case/:/_} --markdown $OUT/${case/:/_}.md 2>&1 | tail -2
  grep "^| $case" $OUT/${case/:/_}.md
done
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/targets/gpu/test_scatter_stores.py 2>&1 | grep -E "^E  |FAILED|passed|failed" | head -10
