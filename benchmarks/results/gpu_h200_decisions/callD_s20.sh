#!/bin/bash
# device call (session 20): the four matrix checkpoints of session 10 (fp16 and bf16; head dims 16, 32, 64; three
# head layers on one) built again with this main's defaults (export.head=answer_rows), each verified on the
# 2,048-decision suite and loaded with the defaults
T0=$(date +%s)
nproc; uptime
timeout 470 python3 benchmarks/gpu_decisions.py --out $OUT --work /tmp/gpu-dec --parallel 4 \
  --build-args "target=sm_90 stages.tilelang=false stages.onnx=false stages.inductor_cache=false" > $OUT/decisions_s20.log 2>&1
echo "rc $? in $(( $(date +%s) - T0 )) s"
tail -20 $OUT/decisions_s20.log
ls $OUT
