#!/bin/bash
# device call A (session 29): first starts on a machine (empty laya-aot cache) of large-1024 (fp16 on disk, served
# in bf16) with what session 29 changed: the build ships its passing probe verdicts (a machine with the build's
# facts runs no probe child), the head start computes the fingerprint beside the artifact's load, and the loader
# waits for that digest instead of hashing the checkpoint a second time. Also shipped since session 28 and not yet
# measured here: the tokenizer snapshot. One build (AOTInductor and TileLang; the decision suite at 256: a start
# does not depend on it), then, each group in its own empty cache:
#   a. the bundle as built (AOTInductor wins the mix): first start, then a later one
#   c. the same bundle as a build on a machine with other facts ships it (no verdict matches: the probe child runs)
#   b. a copy whose manifest gives TileLang the best mix (s26/edit_mix.py): the hand-over's first and later start
T0=$(date +%s)
el() { echo "[callA] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
L=/tmp/s29; mkdir -p $L
nproc; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $L/ckpt.log 2>&1
el checkpoint
python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 target=sm_90 stages.onnx=false \
  stages.inductor_cache=false verify.tolerance.decisions=256 output_dir=/tmp/b-m > $L/build_s29.log 2>&1
el "build rc $?"; grep -E "^(ok|failed|skipped) |bundle written" $L/build_s29.log; cp $L/build_s29.log $OUT/
grep -o '"probe_verdict": {[^}]*}' /tmp/b-m/bundle.json
cp -al /tmp/b-m /tmp/b-e && python3 benchmarks/results/gpu_h200_start/s26/edit_mix.py /tmp/b-e tilelang > $L/edit_s29.log 2>&1
cp -al /tmp/b-m /tmp/b-o && python3 - <<'PY'
import hashlib, json, os
p = "/tmp/b-o/bundle.json"; m = json.load(open(p))
for a in m["artifacts"]:
    if a.get("probe_verdict"):
        a["probe_verdict"]["key"] = hashlib.sha256(b"another machine " + a["name"].encode()).hexdigest()
open(p + ".new", "w").write(json.dumps(m, indent=1)); os.replace(p + ".new", p)
PY
run() {  # tag bundle modes starts
  if [ -f $2/bundle.json ] && [ $(left) -gt 30 ]; then
    timeout $(( $(left) - 5 )) python3 benchmarks/handover_start.py --ckpt /tmp/laya-large-1024-fp16 --bundle $2 \
      --out $L --cache /tmp/cache$1 --starts $4 --repeats 2 --modes $3 --tag $1 > $L/handover$1.log 2>&1
    el "$1 rc $?"; cat $L/handover$1.md 2>/dev/null || tail -3 $L/handover$1.log
    cp $L/handover$1.json $L/handover$1.md $OUT/ 2>/dev/null; tail -2 $L/handover$1.log
  fi
}
run _built_s29 /tmp/b-m aoti 2
run _otherfacts_s29 /tmp/b-o aoti 1
run _handover_s29 /tmp/b-e handover 2
ls $OUT
