#!/bin/bash
# Session 37's device calls, each after the slim site's unpack line (benchmarks/make_slim_site.sh):
#   mkdir -p /tmp/site && { [ -d /tmp/site/fastapi ] || tar -xJf .device-site/site.tar.xz -C /tmp/site; } \
#     && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Not meant to be run as one script. C: the checkpoint, made in each call:
#   python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)"
C=/tmp/laya-large-1024-fp16

# call 1 (an H100, fresh machine, main 08d004b plus the +tma option): three packages compiled side by side,
# two of them autotuning on the one GPU at once. Timing died at a device-side assert (an embedding's index check,
# `0 <= tmp4 < 50368`) in one of the three packages, not isolated; only the compile logs came back (call1_*).
python3 benchmarks/aoti_variants.py --ckpt $C --out $OUT --tag _s37 --variants table,table+autotune,table+autotune+tma \
  --compile-timeout 430 --shapes 1x80,1x128,8x256,32x512,32x1024

# call 2 (an H100, fresh machine): the default package of session 36's bundle (built at 53b7925; the export code
# is unchanged since) as `table`, `table+autotune` compiled alone, each package run once per shape in its own
# process first (--smoke, CUDA_LAUNCH_BLOCKING=1), then timed alternating (call2_*)
tar -xzf .gpu_bundle/b-s32.tgz -C /tmp
python3 benchmarks/aoti_variants.py --ckpt $C --out $OUT --tag _s37b --variants table,table+autotune \
  --prebuilt table=/tmp/b-s32/aoti-sm_90 --smoke --compile-timeout 420 --shapes 1x80,1x128,8x256,32x512,32x1024
CUDA_LAUNCH_BLOCKING=1 python3 benchmarks/aoti_variants.py --ckpt $C --no-graphs \
  --shapes 1x80,1x128,8x256,32x512,32x1024 --smoke-child table+autotune > $OUT/smoke_nographs_s37b.log 2>&1

# call 3: no machine could be started (120 s of budget)

# call 4 (an H200, fresh machine): the encoder's four GEMMs, cuBLAS against Inductor's Triton templates (call4_*)
python3 benchmarks/investigations/gemm_tma_ab.py --out $OUT --tag _s37 --budget-s 300
