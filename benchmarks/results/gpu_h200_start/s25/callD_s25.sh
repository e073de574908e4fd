#!/bin/bash
# device call D (session 25), on call C's machine: starts of the edited copy, alternating load's default (the
# hand-over, now begun after the first call) and prefer="aoti" (the same bundle's AOTInductor artifact, no hand-over)
T0=$(date +%s)
el() { echo "[callD] $(( $(date +%s) - T0 )) s: $*"; }
python3 -m laya_aot.cli inspect /tmp/b-edit > $OUT/inspect_edit_s25d.txt 2>&1
timeout 420 python3 benchmarks/handover_start.py --ckpt /tmp/laya-large-1024-fp16 --bundle /tmp/b-edit --out $OUT \
  --starts 3 --repeats 5 --modes handover,aoti --tag _s25d > $OUT/handover_s25d.log 2>&1
el "handover rc $?"
uptime
