#!/bin/bash
# device call G (session 21): the GeGLU input projection as one Triton kernel (benchmarks/investigations/geglu_mm.py) against cuBLAS +
# Inductor's pointwise kernel, timed from CUDA graphs at the row counts a served forward hands the MLP
T0=$(date +%s)
nproc; uptime; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 420 python3 benchmarks/investigations/geglu_mm_ab.py --out $OUT --tag _s21 > $OUT/geglu_s21.out 2>&1
echo "geglu rc $? in $(( $(date +%s) - T0 )) s"
tail -40 $OUT/geglu_s21.out
