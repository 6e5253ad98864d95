#!/bin/bash
# For the next session's device calls (three, under 10 minutes each); sessions 52 and 53 got no device time:
#   bash scripts/session54_device.sh checks -- session 52's CPU work on CUDA: scatters stored by their message
#       kernels (and torch_geometric's layers with them), operator methods (x.__eq__, as torch 2.11's Dynamo
#       records x == y), host tensors mixed into CUDA kernels (MPNet), session 53's grouped GEMMs and written
#       inputs, session 53's Fourier transforms and complex values, then MPNet, ModernBERT, LLaVA and the four
#       mixtures of experts in bfloat16, FNet and Mamba in float32 (inference and training); session 54's blocked
#       scans, merge-ranked sorts and complex functions
#   bash scripts/session54_device.sh gnn    -- the GNN bench, one case at a time, with its torch_geometric runners
#   bash scripts/session54_device.sh moe    -- session 53's grouped GEMMs timed: scripts/moe_probe.py
#   bash scripts/session54_device.sh long   -- session 54's long sorts and scans, and the DFT GEMMs, timed
export PYTHONPATH=.:tests:scripts TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}
if [ "${1:-checks}" = "checks" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/targets/gpu/test_scatter_stores.py tests/frontend/test_capture.py \
    tests/frontend/test_ops_scatter.py tests/test_backend.py tests/test_backend_partition.py \
    tests/frontend/test_ops_grouped.py tests/targets/gpu/test_grouped_gemm.py tests/test_backend_writes.py \
    tests/frontend/test_ops_fft.py tests/frontend/test_ops_complex.py tests/frontend/test_ops_complex_math.py \
    tests/frontend/test_ops_scan.py tests/frontend/test_ops_sort.py \
    -k "stores or scatter or operator_methods or augmented or torch_geometric or masked or refus or grouped or writ or transforms or complex or rotary or fourier or fft or pairs or blocked or merge or long or gpu" \
    2>&1 | grep -E "^E  |FAILED|passed|failed" | head -30
  timeout 240 python3 scripts/zoo_sweep.py --only MPNet,ModernBert,Llava,Mixtral,Qwen2Moe,Qwen3Moe,Olmoe --dtypes bfloat16 2>&1 | grep -E "^ok|^MIS|^ERR|fallback:|/" | tail -20
  timeout 120 python3 scripts/zoo_sweep.py --only FNet,Mamba --dtypes float32 --train 2>&1 | grep -E "^ok|^MIS|^ERR|fallback:|/" | tail -8
elif [ "$1" = "long" ]; then
  timeout 500 python3 scripts/long_ops_probe.py 2>&1 | grep -E "^\||device|Error|error" | tail -14
elif [ "$1" = "moe" ]; then
  timeout 500 python3 scripts/moe_probe.py --tokens 16,128,1024 2>&1 | grep -E "^\||device|Error|error" | tail -12
else
  for case in gcn:arxiv-synthetic graphsage:arxiv-synthetic gcn:cora graphsage:cora; do
    timeout 140 python3 -m stitchflow.bench.gnn --cases $case --out $OUT/${case/:/_} --markdown $OUT/${case/:/_}.md 2>&1 | tail -2
    grep "^| $case" $OUT/${case/:/_}.md
  done
fi
