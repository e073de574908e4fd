#!/bin/bash
# Written in session 32 for a device call that was not lent (not run yet): large-1024 (fp16 on disk),
# AOTInductor alone. A first start on a machine (no digest cached) waited 0.9-1.3 s for the checkpoint's
# fingerprint (`load_stats.fingerprint_s`, session 31): one thread hashing the 0.8 GB weights. This tree
# ("new") records the weights' `sha256_parts` in the manifest and checks that, its pieces hashed by several
# threads at once; main 4582be0 ("old", `.ab_old/`, carried) reads the same bundle and checks the weights'
# sha256 as before.
# 1. The two digests of the weights file alone, in one process (page cache warm, as after the build).
# 2. First starts as a user's process runs them (`benchmarks/start_once.py`: seconds from the kernel's process
#    start to the first answer), new and old interleaved, each start with an empty laya-aot cache of its own
#    (no digest, no verdict, no tokenizer snapshot cached); the new tree's `load_stats` to a JSON-lines file.
# 3. If time is left, later starts interleaved (caches kept), to see that nothing else moved.
# A dry run on the CPU (the shell's logic, not the figures): SHAPE=tiny TARGET=cpu DEVICE=cpu OUT=DIR bash THIS
SHAPE=${SHAPE:-large-1024}; TARGET=${TARGET:-sm_90}; DEVICE=${DEVICE:-cuda}
T0=$(date +%s)
el() { echo "[first_start_parts] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 575 - ($(date +%s) - T0) )); }
L=/tmp/s32; mkdir -p $L; C=/tmp/laya-$SHAPE-fp16; B=/tmp/b-s32
nproc > $OUT/nproc_s32.txt
[ -f $C/model.safetensors ] || \
  python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('$C','$SHAPE',seed=0)" > $L/ckpt.log 2>&1
el checkpoint
if [ -f .gpu_bundle/b-s32.tgz ]; then  # an earlier call's bundle, carried: no build (the checkpoint above is
  tar -xzf .gpu_bundle/b-s32.tgz -C /tmp  # the same bytes from the same seed; the loader's fingerprint check says so)
  el "bundle carried, not built"
else
  python3 -m laya_aot.cli build checkpoint.path=$C target=$TARGET stages.onnx=false stages.tilelang=false \
    stages.inductor_cache=false verify.tolerance.decisions=256 output_dir=$B > $L/build_s32.log 2>&1
  el "build rc $?"; grep -E "^(ok|failed|skipped) |bundle written" $L/build_s32.log; cp $L/build_s32.log $OUT/
  # for the next calls (carry `.gpu_bundle` with this file in it): everything but the exported program (0.8 GB of
  # weights; no GPU start loads it, and the loader refuses it for its missing files if it ever tries)
  [ -f $B/bundle.json ] && tar -czf $OUT/b-s32.tgz -C /tmp --exclude=exported_program b-s32
fi
[ -f $B/bundle.json ] || exit 1
python3 - $C $B > $OUT/digests_s32.json 2>&1 <<'PY'
import json, sys, time
from pathlib import Path
from laya_aot import files
w = Path(sys.argv[1]) / "model.safetensors"
out = {"bytes": w.stat().st_size, "recorded_parts": json.load(open(Path(sys.argv[2]) / "bundle.json"))["checkpoint"]["fingerprint"].get("parts")}
for name, fn in (("sha256_s", files.sha256_file), ("sha256_parts_s", files.sha256_parts), ("sha256_s_again", files.sha256_file), ("sha256_parts_s_again", files.sha256_parts)):
    t = time.perf_counter(); fn(w); out[name] = round(time.perf_counter() - t, 3)
print(json.dumps(out))
PY
el "digests: $(cat $OUT/digests_s32.json)"
one() {  # label cache command...
  local t; t=$( { LAYA_AOT_CACHE_DIR=$2 LAYA_AOT_PRINT_FIRST_ANSWER=1 timeout 60 "${@:3}" 2>&1 1>/dev/null; } \
    | grep -o 'first answer [0-9.]*' | grep -o '[0-9.]*$')
  echo "$1 ${t:-failed}" | tee -a $OUT/starts_s32.txt
}
NEW="env LAYA_AOT_LOAD_STATS_TO=$OUT/load_stats_s32.jsonl python3 benchmarks/start_once.py bundle $C $B $DEVICE"
OLD="env LAYA_AOT_LOAD_STATS_TO=$OUT/load_stats_old_s32.jsonl PYTHONPATH=/tmp/site:$PWD/.ab_old python3 .ab_old/benchmarks/start_once.py bundle $C $B $DEVICE"
for r in 1 2 3 4 5 6 7 8; do
  [ $(left) -lt 40 ] && break
  if [ $((r % 2)) = 1 ]; then one new_first /tmp/cn$r $NEW; one old_first /tmp/co$r $OLD
  else one old_first /tmp/co$r $OLD; one new_first /tmp/cn$r $NEW; fi
done
el "first starts done"
for r in 1 2 3 4; do
  [ $(left) -lt 25 ] && break
  one new_later /tmp/cn1 $NEW; one old_later /tmp/co1 $OLD
done
el done
