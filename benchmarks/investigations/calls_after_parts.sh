#!/bin/bash
# Written in session 33 (no device lent) for the device call after `first_start_parts.sh`: that call returns the
# large-1024 bundle less its exported program as `$OUT/b-s32.tgz`; carried here in `.gpu_bundle/`, this call
# skips the build (300-410 s) and measures what issues 20 and 24 ask of the default bundle on one machine:
# 1. `gpu_start.py --starts 2`: the three realistic calls as a service times them (bundle and laya eager), the
#    memory after load and the 32x1024 peak, then first and later starts of both paths (issue 20's <= 6 / 5 s).
# 2. `gpu_profile.py --paths bundle`: each call's forward and host split against the dense limit, and the
#    forward-only shapes (issue 24's 1.5x, 10%, 1.0 / 3.0 / 24 / 50 ms).
# 3. `http_bench.py --modes bundle`: requests/s and p50/p99 at 1 / 8 / 32 clients, a reload after idle unload.
# Run after the site unpack line of shared/gpu/README.md and, for the HTTP part:
#   { [ -d /tmp/site/fastapi ] || tar -xJf .device-site/serve-site.tar.xz -C /tmp/site; }
# A dry run on the CPU (the shell's logic, not the figures): SHAPE=tiny TARGET=cpu DEVICE=cpu OUT=DIR bash THIS
SHAPE=${SHAPE:-large-1024}; TARGET=${TARGET:-sm_90}; DEVICE=${DEVICE:-cuda}
T0=$(date +%s)
el() { echo "[calls_after_parts] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( ${BUDGET:-580} - ($(date +%s) - T0) )); }  # BUDGET: seconds this script may take
C=/tmp/laya-$SHAPE-fp16; B=/tmp/b-s32
git log --oneline -1 2>/dev/null; nproc; uptime
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
[ -f $C/model.safetensors ] || \
  python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('$C','$SHAPE',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint
if [ -f .gpu_bundle/b-s32.tgz ]; then
  tar -xzf .gpu_bundle/b-s32.tgz -C /tmp; el "bundle carried, not built"
else  # not carried: build it here, and return it for a later call
  timeout 420 python3 -m laya_aot.cli build checkpoint.path=$C target=$TARGET stages.onnx=false \
    stages.tilelang=false stages.inductor_cache=false verify.tolerance.decisions=256 output_dir=$B \
    > $OUT/build.log 2>&1
  el "build rc $?"
  [ -f $B/bundle.json ] && tar -czf $OUT/b-s32.tgz -C /tmp --exclude=exported_program b-s32
fi
[ -f $B/bundle.json ] || exit 1
python3 -m laya_aot.cli inspect $B > $OUT/inspect.txt 2>&1
if [ $(left) -gt 200 ]; then
  timeout $(( $(left) - 150 )) python3 benchmarks/gpu_start.py --out $OUT --ckpt $C --bundle $B --starts 2 --shape $SHAPE \
    --device $DEVICE --bytecode /tmp/pyc --tag _s33 > $OUT/start.log 2>&1
  el "calls and starts rc $?"
fi
if [ $(left) -gt 110 ]; then
  timeout $(( $(left) - 70 )) python3 benchmarks/gpu_profile.py --out $OUT --ckpt $C --bundle $B --device $DEVICE --shape $SHAPE \
    --paths bundle --repeats 15 --tag _s33 $([ "$DEVICE" = cuda ] || echo --tflops 0) > $OUT/profile.log 2>&1
  el "profile rc $?"
fi
if [ $(left) -gt 40 ]; then
  timeout $(( $(left) - 5 )) python3 benchmarks/http_bench.py --device $DEVICE --checkpoint $C --bundle $B \
    --modes bundle --rounds 1 --requests 300 --timeout 60 --out $OUT --tag s33 > $OUT/http.log 2>&1
  el "http rc $?"
fi
ls -la $OUT; uptime
