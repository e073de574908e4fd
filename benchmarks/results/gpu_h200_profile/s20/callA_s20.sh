#!/bin/bash
# device call A (session 20): the decision head's last layer at the answer rows only (export.head=answer_rows, the
# new default) against the full head (session 19's programs), both AOTInductor packages of large-1024 bf16 compiled
# side by side and timed alternating (benchmarks/aoti_variants.py); then the attention kernel timed from a CUDA
# graph at short and long shapes (benchmarks/attention_ab.py --graph, first run)
T0=$(date +%s)
el() { echo "[callA] $(( $(date +%s) - T0 )) s: $*"; }
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint; nproc; uptime
timeout 400 python3 benchmarks/aoti_variants.py --ckpt /tmp/laya-large-1024-fp16 --out $OUT --tag _s20 \
  --variants table,table+fullhead --compile-timeout 330 --shapes 1x80,1x128,8x256,32x512,32x1024 > $OUT/aoti_variants_s20.out 2>&1
el "variants rc $?"
tail -12 $OUT/aoti_variants_s20.out
timeout 150 python3 benchmarks/attention_ab.py --out $OUT --tag _graph1 --kernel-only --graph \
  --kernel-shapes 1x80,1x128,8x256,32x1024 > $OUT/attention_graph1.out 2>&1
el "attention rc $?"
tail -30 $OUT/attention_graph1.out
cd $OUT && tar -czf callA.tgz *.log *.out *.json *.md 2>/dev/null; ls -la $OUT; uptime
