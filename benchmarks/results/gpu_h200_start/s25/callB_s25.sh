#!/bin/bash
# device call B (session 25), on call A's machine: the compile route (torch's precompiled function) built as a second
# part of the same checkpoint, merged with call A's AOTInductor part (as the CI flow merges parts); a copy of the
# merged bundle whose manifest says the compile route has the best mix (its build figures divided by 3: the compile
# route does not win the mix on this GPU, and the hand-over needs a best mix that starts slowly); then starts of
# that copy, alternating load's default (the hand-over) and handover=False (the start waits for the compile route)
T0=$(date +%s)
el() { echo "[callB] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
git log --oneline -1 2>/dev/null; uptime
timeout 380 python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 output_dir=/tmp/b-compile target=sm_90 \
  stages.onnx=false stages.tilelang=false stages.aoti=false verify.tolerance.decisions=256 \
  > $OUT/build_compile_s25.log 2>&1
echo "build rc $?" >> $OUT/build_compile_s25.log
el build
python3 -m laya_aot.cli merge /tmp/b-both /tmp/b-aoti /tmp/b-compile > $OUT/merge_s25.log 2>&1; echo "merge rc $?" >> $OUT/merge_s25.log
python3 -m laya_aot.cli inspect /tmp/b-both > $OUT/inspect_both_s25.txt 2>&1
cp -al /tmp/b-both /tmp/b-edit && python3 - <<'PY' >> $OUT/merge_s25.log 2>&1
import json, os
p = "/tmp/b-edit/bundle.json"
m = json.load(open(p))
for a in m["artifacts"]:
    if a["kind"] == "compile":
        print("as built", a["name"], a["latency_ms"])
        a["latency_ms"] = {d: {s: round(v / 3, 3) for s, v in f.items()} for d, f in a["latency_ms"].items()}
        print("edited", a["latency_ms"])
    elif a.get("latency_ms"):
        print("as built", a["name"], a["latency_ms"])
open(p + ".new", "w").write(json.dumps(m, indent=1))
os.replace(p + ".new", p)
PY
python3 -m laya_aot.cli inspect /tmp/b-edit > $OUT/inspect_edit_s25.txt 2>&1
el merged
if [ -f /tmp/b-edit/bundle.json ] && [ $(left) -gt 60 ]; then
  timeout $(( $(left) - 10 )) python3 benchmarks/handover_start.py --ckpt /tmp/laya-large-1024-fp16 --bundle /tmp/b-edit \
    --out $OUT --starts 3 --repeats 10 --tag _s25 > $OUT/handover_s25.log 2>&1
  el "handover rc $?"
fi
cd $OUT && tar -czf callB.tgz *.log *.txt *.json *.md 2>/dev/null; ls -la $OUT; uptime
