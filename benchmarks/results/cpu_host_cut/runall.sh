#!/bin/bash
# Before/after of issue 24's host cut on a CPU, alternating: "before" imports the package of a checkout of main
# (PYTHONPATH unset: the venv's editable install points there), "after" the host-cut worktree. Writes to $OUT.
# Checkpoint and bundle: laya_aot.demo.make_checkpoint(DIR, "tiny", seed=0) and
# laya-aot build checkpoint.path=DIR output_dir=BUNDLE stages.aoti=false stages.inductor_cache=false
# (the exported program and the ONNX model, fp32; the ONNX model serves).
cd /work/wt-host
export OMP_NUM_THREADS=1
PY=/work/main/.venv/bin/python
OUT=${OUT:-/tmp/hc/res}
for i in 1 2 3; do
  for side in before after; do
    if [ $side = after ]; then export PYTHONPATH=/work/wt-host; else unset PYTHONPATH; fi
    $PY benchmarks/host_breakdown.py --ckpt /tmp/hc/ckpt --bundle /tmp/hc/bundle --stub --repeats 40 \
      --json $OUT/stub_${side}_$i.json > $OUT/stub_${side}_$i.md 2>/dev/null
  done
done
for i in 1 2; do
  for side in before after; do
    if [ $side = after ]; then export PYTHONPATH=/work/wt-host; else unset PYTHONPATH; fi
    $PY benchmarks/gpu_profile.py --device cpu --tflops 0 --ckpt /tmp/hc/ckpt --bundle /tmp/hc/bundle --shape tiny \
      --paths bundle --repeats 15 --forward-shapes 1x128 --out $OUT --tag _${side}$i > $OUT/prof_${side}_$i.log 2>&1
  done
done
