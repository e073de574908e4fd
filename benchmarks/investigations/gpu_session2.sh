#!/bin/bash
# H200 session 2, call 2: why the CUDA AOTInductor artifact loads slowly, laya fast=True cold, and the
# same-process TileLang A/B. Run from the repo root after the .device-site unpack line; $OUT gets
# gpu_large-1024_run2.{json,md}, build_large-1024_run2.txt, aoti_load_{cold,warm}.txt, ab/gpu_tilelang.json.
set -u
mkdir -p /tmp/kc && tar -xJf .device-kcache/kcache.tar.xz -C /tmp/kc
W=/tmp/laya-aot-gpu-bench
# 1. checkpoint + bundle (no Inductor-cache artifact: not measured in this call)
python3 benchmarks/gpu_bench.py --out $OUT --kernel-cache /tmp/kc --modes none --tag _run2 \
  --build-args "stages.onnx=false stages.inductor_cache=false" --budget-s 300 2>&1 | grep -v "kernel/s" | tail -5
# 2. AOTI load timing: twice, an empty Inductor cache dir, then the same dir again
mkdir -p $W/aoti-cache
for run in cold warm; do
  TORCHINDUCTOR_CACHE_DIR=$W/aoti-cache timeout 120 python3 benchmarks/investigations/aoti_load_time.py /tmp/bundle-large-1024 /tmp/laya-large-1024 \
    > $OUT/aoti_load_$run.txt 2>&1
  grep AOTI_LOAD $OUT/aoti_load_$run.txt | cut -c1-1500
done
# 3. laya fast=True, cold (the JIT fills its own TileLang cache dir)
python3 benchmarks/gpu_bench.py --out $OUT --no-build --modes fast --tag _run2b --timeout 170 --budget-s 180 2>&1 | tail -4
# 4. same-process A/B, laya's JIT kernels from the cache step 3 filled
LAYA_AOT_AB_TL_CACHE=$W/caches/fast/tilelang timeout 150 python3 benchmarks/gpu_tilelang.py run --ckpt /tmp/laya-large-1024 \
  --bundle /tmp/bundle-large-1024/tilelang --out $OUT/ab --budget-s 140 --ab --skip-bundle --skip-baseline 2>&1 | grep "\[ab\]"
rm -f $OUT/gpu_large-1024_run2.md
