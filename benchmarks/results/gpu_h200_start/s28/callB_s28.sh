#!/bin/bash
# (edit_mix.py: session 26's script; this call ran a byte-identical copy, md5 321ce906, since removed)
# device call B (session 28), on call A's machine (or the tail of call A, BUDGET seconds): merge the two parts as the
# CI flow merges them, inspect the merged bundle (its mix as built); a copy whose manifest gives TileLang the best
# mix (edit_mix.py: TileLang's figures divided by 3, so that a start has a slow-starting best mix to hand over to);
# starts of that copy alternating load's default (the hand-over), prefer="aoti" and handover=False (TileLang's own
# start), handover_start.py. Steps already done (merged bundle, hand-over results) are not repeated.
T0=$(date +%s)
el() { echo "[callB] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( ${BUDGET:-585} - ($(date +%s) - T0) )); }
S=benchmarks/results/gpu_h200_start/s28; L=/tmp/s28
uptime
done2() { [ $(grep -l "build rc" $L/build_*_s28.log 2>/dev/null | wc -l) -eq 2 ]; }
while ! done2 && [ $(left) -gt 200 ]; do sleep 5; done
el builds; for f in $L/build_*_s28.log; do echo "== $f"; grep -E "^(ok|failed|skipped) |build rc|bundle written" $f; done
if [ ! -f /tmp/b-e/bundle.json ]; then
  python3 -m laya_aot.cli merge /tmp/b-m /tmp/b-aoti /tmp/b-tl > $L/merge_s28.log 2>&1; echo "merge rc $?" >> $L/merge_s28.log
  python3 -m laya_aot.cli inspect /tmp/b-m > $L/inspect_merged_s28.txt 2>&1
  cp -al /tmp/b-m /tmp/b-e && python3 benchmarks/results/gpu_h200_start/s26/edit_mix.py /tmp/b-e tilelang >> $L/merge_s28.log 2>&1
  python3 -m laya_aot.cli inspect /tmp/b-e > $L/inspect_edit_s28.txt 2>&1
  el merged; cat $L/merge_s28.log $L/inspect_merged_s28.txt; tail -3 $L/inspect_edit_s28.txt
fi
if [ -f /tmp/b-e/bundle.json ] && [ ! -f $L/handover_large_tl_s28.json ] && [ $(left) -gt 60 ]; then
  timeout $(( $(left) - 15 )) python3 benchmarks/handover_start.py --ckpt /tmp/laya-large-1024-fp16 --bundle /tmp/b-e \
    --out $L --starts 3 --repeats 5 --modes handover,aoti,wait --tag _large_tl_s28 > $L/handover_large_tl_s28.log 2>&1
  el "handover rc $?"; cat $L/handover_large_tl_s28.md
fi
cp $L/*.log $L/*.txt $L/*.json $L/*.md $OUT/ 2>/dev/null; ls $OUT; uptime
