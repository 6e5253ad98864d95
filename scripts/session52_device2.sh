#!/bin/bash
# Session 52's second device call: the fixes its first call asked for (x.__eq__ and kin as Dynamo 2.11 records
# them; host tensors mixed into CUDA kernels), scatters stored by their message kernels, then the GNN bench.
export PYTHONPATH=.:tests:scripts TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/targets/gpu/test_scatter_stores.py tests/frontend/test_capture.py \
  tests/frontend/test_ops_scatter.py tests/test_backend.py -k "stores or scatter or operator_methods or augmented or torch_geometric" \
  2>&1 | grep -E "^E  |FAILED|passed|failed" | head -30
timeout 100 python3 scripts/zoo_sweep.py --only MPNet,ModernBert,Llava --dtypes bfloat16 2>&1 | grep -E "^ok|^MIS|^ERR|fallback:|/" | tail -12
timeout 330 python3 -m stitchflow.bench.gnn --out $OUT/g --markdown $OUT/G.md 2>&1 | tail -5
cat $OUT/G.md | head -16
