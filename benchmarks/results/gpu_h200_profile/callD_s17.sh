#!/bin/bash
# device call D (session 17): where the default bundle's host time goes on the H200 (diagnostic for the 1x1 call)
T0=$(date +%s); O=/tmp/od; mkdir -p $O
el() { echo "[callD] $(( $(date +%s) - T0 )) s: $*"; }
[ -f /tmp/laya-large-1024-fp16/model.safetensors ] || python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $O/ckpt.log 2>&1
[ -d /tmp/bundle-l1024 ] || tar -xzf .gpu-carry/bundle-l1024.tgz -C /tmp
el checkpoint
timeout 90 python3 benchmarks/host_breakdown.py --ckpt /tmp/laya-large-1024-fp16 --bundle /tmp/bundle-l1024 --device cuda \
  --repeats 25 --json $O/host_breakdown_h200_host1.json > $O/host_breakdown_h200_host1.md 2>$O/host_breakdown.err
el breakdown
timeout 90 python3 benchmarks/gpu_profile.py --out $O --tag _host1 --bundle /tmp/bundle-l1024 --paths bundle --repeats 15 \
  --calls 1x1q_20w,8x3q_120w --cprofile > $O/profile_host1.log 2>&1
el profile
tar -czf $OUT/callD.tgz -C $O .
cat $O/host_breakdown_h200_host1.md | tail -15
