#!/bin/bash
# device call B (session 17): the TileLang route's start after the probe-entry fix, against the default AOTI bundle
T0=$(date +%s); O=/tmp/ob; mkdir -p $O
el() { echo "[callB] $(( $(date +%s) - T0 )) s: $*"; }
[ -f /tmp/laya-large-1024-fp16/model.safetensors ] || python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $O/ckpt.log 2>&1
el checkpoint
[ -d /tmp/bundle-l1024 ] || tar -xzf .gpu-carry/bundle-l1024.tgz -C /tmp
rm -rf /tmp/kcache; tar -xJf .gpu-carry/kcache.tar.xz -C /tmp
uptime
[ -f /tmp/bundle-tl/bundle.json ] || LAYA_AOT_KERNEL_CACHE=/tmp/kcache timeout 330 python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 output_dir=/tmp/bundle-tl target=sm_90 \
  stages.onnx=false stages.aoti=false stages.inductor_cache=false verify.tolerance.decisions=256 > $O/build_tl1.log 2>&1 && echo "build rc $?" >> $O/build_tl1.log
el build
python3 -m laya_aot.cli inspect /tmp/bundle-tl > $O/inspect_tl1.txt 2>&1
timeout 200 python3 benchmarks/gpu_start.py --out $O --bundle /tmp/bundle-l1024 --second-bundle /tmp/bundle-tl \
  --second-prefer tilelang --no-eager --starts 3 --skip-calls --bytecode /tmp/pyc --tag _tl1 > $O/start_tl1.log 2>&1
echo "start rc $?" >> $O/start_tl1.log
el start
uptime
tar -czf $OUT/callB.tgz -C $O .
tail -30 $O/start_tl1.log
