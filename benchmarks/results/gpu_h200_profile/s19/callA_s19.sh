#!/bin/bash
# device call A (session 19): the rotary A/B on ONE machine. Two bundles of the same checkpoint built side by side
# (export.rotary=table, the default, and export.rotary=computed, the form before session 18), then profiled
# alternately (table, computed, table, computed), then their starts alternating (#20's figures for the default)
T0=$(date +%s)
el() { echo "[callA] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 575 - ($(date +%s) - T0) )); }
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint; nproc; uptime
B="checkpoint.path=/tmp/laya-large-1024-fp16 target=sm_90 stages.onnx=false stages.tilelang=false stages.inductor_cache=false jobs=8"
(timeout 460 python3 -m laya_aot.cli build $B output_dir=/tmp/b-table > $OUT/build_table2.log 2>&1; echo "build rc $?" >> $OUT/build_table2.log) &
(timeout 460 python3 -m laya_aot.cli build $B output_dir=/tmp/b-computed export.rotary=computed > $OUT/build_computed2.log 2>&1; echo "build rc $?" >> $OUT/build_computed2.log) &
wait
el builds; tail -12 $OUT/build_table2.log $OUT/build_computed2.log
for round in 1 2; do
  for v in table computed; do
    if [ $(left) -gt 40 ] && [ -f /tmp/b-$v/bundle.json ]; then
      timeout 40 python3 benchmarks/gpu_profile.py --out $OUT --tag _${v}2_r$round --bundle /tmp/b-$v --paths bundle --repeats 15 > $OUT/profile_${v}2_r$round.log 2>&1
      el "profile $v round $round rc $?"
    fi
  done
done
if [ $(left) -gt 60 ]; then
  timeout $(( $(left) - 15 )) python3 benchmarks/gpu_start.py --out $OUT --bundle /tmp/b-table --second-bundle /tmp/b-computed \
    --no-eager --starts 2 --skip-calls --bytecode /tmp/pyc --tag _s19 > $OUT/start_s19.log 2>&1
  el "starts rc $?"
fi
python3 -m laya_aot.cli inspect /tmp/b-table > $OUT/inspect_table2.txt 2>&1
cd $OUT && tar -czf callA.tgz *.log *.txt *.json *.md 2>/dev/null; ls -la $OUT; uptime
