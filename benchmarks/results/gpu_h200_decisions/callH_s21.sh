#!/bin/bash
# device call H (session 21): the decision head A/B on one machine. Two matrix checkpoints whose stored agreement
# fell after session 20's rebuild (hd64-bf16-ctx1024: 8 decisions, hd16-16heads-fp16: 1) built twice each, with
# export.head=full (session 19's programs) and with the default export.head=answer_rows, all four in parallel,
# each verified on the 2,048-decision suite
T0=$(date +%s)
nproc; uptime
B="target=sm_90 stages.tilelang=false stages.onnx=false stages.inductor_cache=false"
mkdir -p $OUT/full $OUT/rows
timeout 520 python3 benchmarks/gpu_decisions.py --out $OUT/full --work /tmp/dec-full --parallel 2 \
  --names hd64-bf16-ctx1024,hd16-16heads-fp16 --build-args "$B export.head=full" > $OUT/full/decisions_full_s21.log 2>&1 &
timeout 520 python3 benchmarks/gpu_decisions.py --out $OUT/rows --work /tmp/dec-rows --parallel 2 \
  --names hd64-bf16-ctx1024,hd16-16heads-fp16 --build-args "$B" > $OUT/rows/decisions_rows_s21.log 2>&1 &
wait
echo "both done in $(( $(date +%s) - T0 )) s"
tail -8 $OUT/full/decisions_full_s21.log $OUT/rows/decisions_rows_s21.log
cat $OUT/full/gpu_decisions.md $OUT/rows/gpu_decisions.md 2>/dev/null | head -60
cd $OUT && tar -czf callH.tgz full rows && rm -rf full/*.log rows/*.log; ls -la $OUT
