#!/bin/bash
# For the next session's device calls (two, under 10 minutes each):
#   bash scripts/session52_device.sh checks  -- session 51's CPU work on CUDA: the scatters (and the one-row
#       index_put fix), nn's attention modules, torch_geometric's layers through the backend, masked_scatter,
#       outputs made on the host; then the bfloat16 inference of the 18 architectures session 51 added to the zoo
#   bash scripts/session52_device.sh gnn     -- the GNN bench with its torch_geometric-through-the-backend runners
export PYTHONPATH=.:tests:scripts TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}
if [ "${1:-checks}" = "checks" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/targets/gpu/test_scatter_stores.py 2>&1 | grep -E "^E  |FAILED|passed|failed" | head -20
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/frontend/test_ops_scatter.py tests/frontend/test_ops_mha.py \
    tests/test_backend.py -k "scatter or attention_modules or torch_geometric or eager_made or masked or not_lowered" \
    2>&1 | grep -E "^E  |FAILED|passed|failed" | head -30
  NEW=LlamaForSequence,Qwen2Moe,Granite,Cohere,StableLm,GPTBigCode,GPTNeo,Electra,Albert,XLMRoberta,MPNet,FNet
  NEW=$NEW,ModernBert,Olmoe,Dinov2,Segformer,Beit,SiglipVision,Llava
  timeout 300 python3 scripts/zoo_sweep.py --only $NEW --dtypes bfloat16 2>&1 | grep -E "^ok|^MIS|^ERR|fallback:|/" | tail -45
else
  timeout 560 python3 -m stitchflow.bench.gnn --out $OUT/g --markdown $OUT/G.md 2>&1 | tail -12
  head -20 $OUT/G.md
fi
