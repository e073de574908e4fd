#!/bin/bash
# device call B (session 27), on call A's machine: wait for call A's builds, merge the two parts as the CI flow
# merges them, inspect the merged bundle (its mix as built: AOTInductor now timed with the CUDA graphs it serves
# with); a copy whose manifest gives TileLang the best mix (edit_mix.py: TileLang's figures divided by 3, so that
# a start has a slow-starting best mix to hand over to); starts of that copy alternating load's default (the
# hand-over), prefer="aoti" and handover=False (TileLang's own start), handover_start.py.
T0=$(date +%s)
el() { echo "[callB] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
S=benchmarks/results/gpu_h200_start/s27; L=/tmp/s27
uptime
done2() { [ $(grep -l "build rc" $L/build_*_s27.log 2>/dev/null | wc -l) -eq 2 ]; }
while ! done2 && [ $(( $(date +%s) - T0 )) -lt 300 ]; do sleep 5; done
el builds; for f in $L/build_*_s27.log; do echo "== $f"; grep -E "^(ok|failed|skipped) |build rc|bundle written" $f; done
python3 -m laya_aot.cli merge /tmp/b-m /tmp/b-aoti /tmp/b-tl > $L/merge_s27.log 2>&1; echo "merge rc $?" >> $L/merge_s27.log
python3 -m laya_aot.cli inspect /tmp/b-m > $L/inspect_merged_s27.txt 2>&1
cp -al /tmp/b-m /tmp/b-e && python3 $S/edit_mix.py /tmp/b-e tilelang >> $L/merge_s27.log 2>&1
python3 -m laya_aot.cli inspect /tmp/b-e > $L/inspect_edit_s27.txt 2>&1
el merged; cat $L/merge_s27.log $L/inspect_merged_s27.txt; tail -3 $L/inspect_edit_s27.txt
if [ -f /tmp/b-e/bundle.json ] && [ $(left) -gt 60 ]; then
  timeout $(( $(left) - 15 )) python3 benchmarks/handover_start.py --ckpt /tmp/laya-large-1024-fp16 --bundle /tmp/b-e \
    --out $L --starts 3 --repeats 5 --modes handover,aoti,wait --tag _large_tl_s27 > $L/handover_large_tl_s27.log 2>&1
  el "handover rc $?"; cat $L/handover_large_tl_s27.md
fi
cd $L && tar -czf $OUT/callB.tgz *.log *.txt *.json *.md 2>/dev/null; cp $L/handover_large_tl_s27.* $L/inspect_*_s27.txt $OUT/ 2>/dev/null; ls $OUT; uptime
