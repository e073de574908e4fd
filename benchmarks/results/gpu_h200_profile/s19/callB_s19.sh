#!/bin/bash
# device call B (session 19): three AOTInductor packages of large-1024 bf16 compiled side by side on one machine
# (rotary table = the default; rotary computed = before session 18; table with Inductor max-autotune), then their
# forwards timed alternating at issue 24's shapes (benchmarks/aoti_variants.py)
T0=$(date +%s)
el() { echo "[callB] $(( $(date +%s) - T0 )) s: $*"; }
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint; nproc; uptime
timeout 560 python3 benchmarks/aoti_variants.py --ckpt /tmp/laya-large-1024-fp16 --out $OUT --tag _s19 \
  --variants table,computed,table+autotune --compile-timeout 440 > $OUT/aoti_variants_s19.out 2>&1
el "variants rc $?"
tail -20 $OUT/aoti_variants_s19.out
cd $OUT && tar -czf callB.tgz *.log *.out *.json *.md 2>/dev/null; ls -la $OUT; uptime
