#!/bin/bash
# device call A (session 17): the rotary fusion built, verified and profiled against the default bundle
set -x
T0=$(date +%s)
el() { echo "[callA] $(( $(date +%s) - T0 )) s: $*"; }
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint
tar -xzf .gpu-carry/bundle-l1024.tgz -C /tmp
nproc; uptime
timeout 450 python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 output_dir=/tmp/bundle-rope target=sm_90 \
  stages.onnx=false stages.tilelang=false stages.inductor_cache=false export.attention=triton_rope > $OUT/build_rope1.log 2>&1
echo "build rc $?" >> $OUT/build_rope1.log
el build
python3 -m laya_aot.cli inspect /tmp/bundle-rope > $OUT/inspect_rope1.txt 2>&1
tar -czf $OUT/bundle-rope.tgz -C /tmp bundle-rope 2>/dev/null; ls -la $OUT
el inspect
for b in rope:/tmp/bundle-rope base:/tmp/bundle-l1024; do
  n=${b%%:*}; p=${b#*:}
  [ -f $p/bundle.json ] || continue
  K=""; [ $n = rope ] && K="--kernels"
  timeout 75 python3 benchmarks/gpu_profile.py --out $OUT --tag _${n}1 --bundle $p --paths bundle --repeats 15 $K > $OUT/profile_${n}1.log 2>&1
  el profile $n
done
timeout 60 python3 benchmarks/rope_ab.py --out $OUT --shapes 16x1024,8x256 > $OUT/rope_ab.log 2>&1
el rope_ab
uptime
