export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
M=""
for r in math_pipe_throttle wait long_scoreboard short_scoreboard barrier membar mio_throttle lg_throttle dispatch_stall no_instruction not_selected selected sleeping drain branch_resolving misc; do M="$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
M="${M:1},sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.sum,sm__inst_executed_pipe_fma.sum,sm__inst_executed_pipe_alu.sum,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__cycles_elapsed.avg"
for act in gelu none; do
echo "=== $act"
timeout 120 ncu --kernel-name regex:chain_wgmma --launch-skip 2 --launch-count 1 --metrics $M python3 scripts/wgmma_ncu.py $act 2>&1 | grep -E "^\s+(smsp|sm__|dram|gpu__)" | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//'
done
