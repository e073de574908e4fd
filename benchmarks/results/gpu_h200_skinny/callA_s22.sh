#!/bin/bash
# device call A (session 22): the encoder's linears at few tokens, cuBLASLt / cuBLAS / a Triton tile sweep, each
# from one CUDA graph over a stack of distinct per-layer weights (benchmarks/investigations/skinny_gemm.py)
T0=$(date +%s)
nproc; uptime; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 500 python3 benchmarks/investigations/skinny_gemm.py --out $OUT --tag _s22 > $OUT/skinny_s22.out 2>&1
echo "skinny rc $? in $(( $(date +%s) - T0 )) s"
grep -v skipped $OUT/skinny_s22.out | tail -45
