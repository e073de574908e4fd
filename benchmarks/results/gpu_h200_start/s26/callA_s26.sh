#!/bin/bash
# device call A (session 26): large-1024 (fp16 on disk, served in bf16), then three parts built at once, each with the
# decision suite at 256 (a start does not depend on it): AOTInductor; TileLang; the compile route. They run under
# setsid, so they go on between calls on this machine; this call waits for them (up to 560 s) and copies the logs.
T0=$(date +%s)
el() { echo "[callA] $(( $(date +%s) - T0 )) s: $*"; }
git log --oneline -1 2>/dev/null; nproc; uptime; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
mkdir -p /tmp/s26
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > /tmp/s26/ckpt.log 2>&1
el checkpoint
B="python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 target=sm_90 stages.onnx=false verify.tolerance.decisions=256"
part() {  # name, overrides
  setsid bash -c "$B output_dir=/tmp/b-$1 $2 > /tmp/s26/build_$1_s26.log 2>&1; echo build rc \$? >> /tmp/s26/build_$1_s26.log" \
    < /dev/null > /dev/null 2>&1 &
}
part aoti "stages.tilelang=false stages.inductor_cache=false"
part tl "stages.aoti=false stages.inductor_cache=false"
part compile "stages.aoti=false stages.tilelang=false"
done3() { [ $(grep -l "build rc" /tmp/s26/build_*_s26.log 2>/dev/null | wc -l) -eq 3 ]; }
while ! done3 && [ $(( $(date +%s) - T0 )) -lt 560 ]; do sleep 5; done
el "waited"; for f in /tmp/s26/build_*_s26.log; do echo "== $f"; grep -E "^(ok|failed|skipped) |build rc|bundle written" $f; done
uptime; cp /tmp/s26/*.log $OUT/
