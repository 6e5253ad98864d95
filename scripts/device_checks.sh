#!/bin/bash
# The next session's device calls (each under 10 minutes). Full logs go to $OUT (they come back as files); the
# summaries print last, so that the reply's output tail holds them.
#   bash scripts/device_checks.sh checks -- sessions 52-54's CPU work on CUDA: scatters stored by their message
#       kernels (session 54 fixed their atomics' scalar address, unverified), grouped GEMMs, written inputs, Fourier
#       transforms and complex values, blocked scans, merge-ranked sorts, searchsorted; then MPNet, ModernBERT,
#       LLaVA and the four mixtures of experts in bfloat16 (session 54 folded their get_device_capability calls,
#       unverified), FNet and Mamba in float32 with training; session 55's dynamic-shape, torch.func and random tests
#   bash scripts/device_checks.sh gnn    -- the GNN bench, one case at a time, with its torch_geometric runners
#   bash scripts/device_checks.sh moe    -- the grouped GEMMs timed: scripts/moe_probe.py
#   bash scripts/device_checks.sh long   -- long sorts and scans, and the DFT GEMMs, timed: scripts/long_ops_probe.py
export PYTHONPATH=.:tests:scripts TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "${1:-checks}" = "checks" ]; then
  timeout 120 python3 scripts/zoo_sweep.py --only FNet,Mamba --dtypes float32 --train > "$OUT/zoo_fp32.log" 2>&1
  timeout 240 python3 scripts/zoo_sweep.py --only MPNet,ModernBert,Llava,Mixtral,Qwen2Moe,Qwen3Moe,Olmoe \
    --dtypes bfloat16 > "$OUT/zoo_bf16.log" 2>&1
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/targets/gpu/test_scatter_stores.py tests/frontend/test_capture.py \
    tests/frontend/test_ops_scatter.py tests/test_backend.py tests/test_backend_partition.py \
    tests/frontend/test_ops_grouped.py tests/targets/gpu/test_grouped_gemm.py tests/test_backend_writes.py \
    tests/frontend/test_ops_fft.py tests/frontend/test_ops_complex.py tests/frontend/test_ops_complex_math.py \
    tests/frontend/test_ops_scan.py tests/frontend/test_ops_sort.py \
    -k "stores or scatter or operator_methods or augmented or torch_geometric or masked or refus or grouped or writ or transforms or complex or rotary or fourier or fft or pairs or blocked or merge or long or insertion or question or gpu" \
    > "$OUT/pytest.log" 2>&1
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_backend_dynamic.py tests/test_backend_func.py \
    tests/frontend/test_ops_random.py > "$OUT/pytest_dynamic.log" 2>&1
  grep -E "^ok|^MIS|^ERR|fallback:|/[0-9]+ ok" "$OUT/zoo_fp32.log" "$OUT/zoo_bf16.log" | cut -c1-160 | tail -24
  grep -E "error:|^FAILED|passed|failed" "$OUT/pytest.log" "$OUT/pytest_dynamic.log" | cut -c1-200 | tail -16
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
