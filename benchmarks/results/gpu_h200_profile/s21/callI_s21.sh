#!/bin/bash
# device call I (session 21): export.head=answer_rows with the head's self-attention batch-first (the default now)
# against export.head=full (laya's head as it is), both AOTInductor packages of large-1024 bf16 compiled side by side
# and timed alternating (benchmarks/aoti_variants.py), as session 20's call A
T0=$(date +%s)
el() { echo "[callI] $(( $(date +%s) - T0 )) s: $*"; }
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint; nproc; uptime
timeout 330 python3 benchmarks/aoti_variants.py --ckpt /tmp/laya-large-1024-fp16 --out $OUT --tag _s21 \
  --variants table,table+fullhead --compile-timeout 300 --shapes 1x80,1x128,8x256,32x1024 > $OUT/aoti_variants_s21.out 2>&1
el "variants rc $?"
tail -12 $OUT/aoti_variants_s21.out
ls $OUT
