#!/bin/bash
# Session 51's device sweep: session 50's backend rewrites on CUDA, the new zoo architectures in bf16 and a
# float32 training step, and Mamba's CUDA training step. One call; each part bounded by its own timeout.
export PYTHONPATH=.:tests:scripts TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 120 python3 scripts/backend_rewrites_device_check.py --device cuda 2>&1 | tail -40
NEW=Qwen3,Phi3,Gemma2,Gemma3,Starcoder2,Olmo,GPTJ,Mixtral,Qwen3Moe,Mamba2,CLIPVision
timeout 200 python3 scripts/zoo_sweep.py --only $NEW --dtypes bfloat16 2>&1 | grep -v Warning | tail -40
timeout 150 python3 scripts/zoo_sweep.py --only $NEW --dtypes float32 --train 2>&1 | grep -v Warning | tail -40
timeout 100 python3 scripts/mamba_train_probe.py --device cuda --scan default --stacks $OUT/stacks.txt --dump-s 80 2>&1 | tail -30
