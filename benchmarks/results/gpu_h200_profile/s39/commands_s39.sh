#!/bin/bash
# Session 39's device calls (thirteen: five ran on H100s though each asked for nvidia-h200, the fourth and fifth
# running nothing for that reason; calls 6-13 found no machine), each after the slim site's unpack line
# (benchmarks/make_slim_site.sh):
#   mkdir -p /tmp/site && { [ -d /tmp/site/fastapi ] || tar -xJf .device-site/site.tar.xz -C /tmp/site; } \
#     && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Not meant to be run as one script. The package timed is session 36's bundle's aoti-sm_90 (built at 53b7925 on an
# H200; the export code is unchanged since), carried as .gpu_bundle/b-s32.tgz.
tar -xzf .gpu_bundle/b-s32.tgz -C /tmp
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)"

# call 1 (forward_floor.py as of 7582191: attention from SDPA's backends only, no local-floor column): call1_*
python3 benchmarks/investigations/forward_floor.py --ckpt /tmp/laya-large-1024-fp16 --package /tmp/b-s32/aoti-sm_90 \
  --out $OUT --tag _s39a

# call 2 (as of e0f65fe: plus the local layers' computed floor), twice, then the shipped attention kernel alone
# against SDPA with transformers' dense masks at three shapes, seven tilings (call2_*)
for t in b c; do
  python3 benchmarks/investigations/forward_floor.py --ckpt /tmp/laya-large-1024-fp16 \
    --package /tmp/b-s32/aoti-sm_90 --out $OUT --tag _s39$t
done
python3 benchmarks/attention_ab.py --out $OUT --tag _s39 --kernel-only --kernel-shapes 8x256,32x512,32x1024 --graph

# call 3 (as of 5ad754f, before 0c77bbd gave each skeleton layer its own weights: each kind of layer's attention
# the fastest of SDPA's flash and cuDNN backends and the package's own kernel), twice (call3_*)
for t in d e; do
  python3 benchmarks/investigations/forward_floor.py --ckpt /tmp/laya-large-1024-fp16 \
    --package /tmp/b-s32/aoti-sm_90 --out $OUT --tag _s39$t
done

# calls 4 and 5: the same as call 3 if the card is an H200; call 4 found the same warm H100, call 5 a fresh H100,
# so nothing ran. Calls 6-13 (call 3's commands with forward_floor.py giving each layer its own weights, 0c77bbd,
# on an H200 or an H100): five machine starts failed and three calls were refused at once during the lockouts.
