#!/bin/bash
# Session 51's second device sweep: the scatter lowerings and the host outputs on CUDA, the zoo models that fell
# back in the first sweep, and Mamba's CUDA training step with time to finish.
export PYTHONPATH=.:tests:scripts TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/frontend/test_ops_scatter.py \
  tests/test_backend.py -k "scatter or eager_made or another_device or reads_no_tensor" 2>&1 | tail -4
timeout 150 python3 scripts/zoo_sweep.py --only Starcoder2,Gemma3 --dtypes bfloat16 2>&1 | grep -E "^ok|^MIS|^ERR|fallback|/" | tail -8
timeout 120 python3 scripts/zoo_sweep.py --only Gemma3,Starcoder2 --dtypes float32 --train 2>&1 | grep -E "^ok|^MIS|^ERR|fallback|/" | tail -10
timeout 280 python3 scripts/mamba_train_probe.py --device cuda --scan default --stacks $OUT/stacks.txt --dump-s 240 2>&1 | grep -v "Warning\|warn_once\|originates\|^ *$\|File\|if is_" | tail -12
