#!/bin/bash
# device call D (session 22): the new GPU default (the export traced at 8 x 1024) against the old example (3 x 48) and an
# intermediate one (2 x 512), large-1024 bf16, compiled side by side and timed alternating (benchmarks/aoti_variants.py)
T0=$(date +%s)
el() { echo "[callD] $(( $(date +%s) - T0 )) s: $*"; }
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint; nproc; uptime
timeout 360 python3 benchmarks/aoti_variants.py --ckpt /tmp/laya-large-1024-fp16 --out $OUT --tag _s22d \
  --variants table,table+hint3x48,table+hint2x512 --compile-timeout 250 --shapes 1x80,1x128,8x256,32x512,32x1024 \
  > $OUT/aoti_variants_s22d.out 2>&1
el "variants rc $?"
tail -16 $OUT/aoti_variants_s22d.out
