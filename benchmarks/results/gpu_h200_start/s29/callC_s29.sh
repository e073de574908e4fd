#!/bin/bash
# device call C (session 29): later starts of the AOTInductor bundle beside laya eager's start and a floor (a process
# that only imports torch and laya and makes its CUDA context), interleaved on one machine: call B's later starts
# (5.10-5.96 s) were over issue 20's 5 s, and its `-X importtime` put `import torch` at 3.5 s; this call says how
# much of a later start is that floor on the same machine. large-1024 (fp16 on disk), AOTInductor alone.
# Each start: `benchmarks/start_once.py` with LAYA_AOT_PRINT_FIRST_ANSWER=1 (seconds from the kernel's process start
# to the first answer; the interpreter's exit is not counted).
T0=$(date +%s)
el() { echo "[callC] $(( $(date +%s) - T0 )) s: $*"; }
L=/tmp/s29c; mkdir -p $L; C=/tmp/laya-large-1024-fp16; export LAYA_AOT_CACHE_DIR=/tmp/cache_c
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('$C','large-1024',seed=0)" > $L/ckpt.log 2>&1
el checkpoint
python3 -m laya_aot.cli build checkpoint.path=$C target=sm_90 stages.onnx=false stages.tilelang=false \
  stages.inductor_cache=false verify.tolerance.decisions=256 output_dir=/tmp/b-c > $L/build_c_s29.log 2>&1
el "build rc $?"; grep -E "^(ok|failed|skipped) |bundle written" $L/build_c_s29.log
cat > $L/floor.py <<'PY'
import os, sys, time
import torch, laya  # noqa: F401
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
with open("/proc/self/stat") as f:
    started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
print("first answer %.3f s after the process started" % (time.clock_gettime(time.CLOCK_BOOTTIME) - started), file=sys.stderr)
PY
one() {  # label command...
  local t; t=$( { LAYA_AOT_PRINT_FIRST_ANSWER=1 timeout 60 "${@:2}" 2>&1 1>/dev/null; } | grep -o 'first answer [0-9.]*' | grep -o '[0-9.]*$')
  echo "$1 ${t:-failed}" | tee -a $OUT/starts_c_s29.txt
}
if [ -f /tmp/b-c/bundle.json ]; then
  one bundle_first python3 benchmarks/start_once.py bundle $C /tmp/b-c cuda
  for r in 1 2 3 4; do
    [ $(( $(date +%s) - T0 )) -gt 540 ] && break
    one bundle python3 benchmarks/start_once.py bundle $C /tmp/b-c cuda
    one eager python3 benchmarks/start_once.py eager $C - cuda
    one floor python3 $L/floor.py
  done
fi
cp $L/build_c_s29.log $OUT/; el done
