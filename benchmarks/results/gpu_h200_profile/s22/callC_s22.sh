#!/bin/bash
# device call C (session 22): the default AOTInductor package of large-1024 bf16 against the same export traced at an
# example of 8 x 1024 tokens (Inductor tunes its own kernels' launch settings at the example's sizes; the build's
# example is 3 x 48), with and without Inductor's coordinate-descent tuning, compiled side by side and timed
# alternating (benchmarks/aoti_variants.py), as session 21's call I
T0=$(date +%s)
el() { echo "[callC] $(( $(date +%s) - T0 )) s: $*"; }
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint; nproc; uptime
timeout 520 python3 benchmarks/aoti_variants.py --ckpt /tmp/laya-large-1024-fp16 --out $OUT --tag _s22 \
  --variants table,table+hint8x1024,table+hint8x1024+cdt --compile-timeout 400 --shapes 1x80,1x128,8x256,32x512,32x1024 \
  > $OUT/aoti_variants_s22.out 2>&1
el "variants rc $?"
tail -16 $OUT/aoti_variants_s22.out
ls $OUT
