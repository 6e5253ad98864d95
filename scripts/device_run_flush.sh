# One device call: the reduction-body variants of the column patterns, then the transformer blocks, all timed
# with the clean L2 flush. Outputs under $OUT.
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 STITCHFLOW_CACHE=/tmp/sfc1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 scripts/reduction_body_probe.py 2>&1 | grep -v Warn | tee $OUT/body.log
python3 -m stitchflow.bench.stitching_blocks --apps bert,llama --out $OUT/blocks.json --markdown $OUT/blocks.md > $OUT/blocks.log 2>&1
tail -8 $OUT/blocks.md
