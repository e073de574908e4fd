#!/bin/bash
# Session 30 wrote it, session 31 ran it (call 1): large-1024 (fp16 on disk), AOTInductor alone, then
# start_tail.py three times in fresh processes, then five starts through handover_start.py (one first, four later)
# with session 30's head start (no warm-up call where the smoke check follows). ~480 s of a 600 s call.
T0=$(date +%s)
el() { echo "[start_tail] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
L=/tmp/st; mkdir -p $L; C=/tmp/laya-large-1024-fp16
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('$C','large-1024',seed=0)" > $L/ckpt.log 2>&1
el checkpoint
python3 -m laya_aot.cli build checkpoint.path=$C target=sm_90 stages.onnx=false stages.tilelang=false \
  stages.inductor_cache=false verify.tolerance.decisions=256 output_dir=/tmp/b-st > $L/build.log 2>&1
el "build rc $?"; grep -E "^(ok|failed|skipped) |bundle written" $L/build.log; cp $L/build.log $OUT/build_st.log
for r in 1 2 3; do
  timeout 60 python3 benchmarks/investigations/start_tail.py /tmp/b-st $C --name aoti-sm_90 2>&1 | tail -1 \
    | tee -a $OUT/start_tail_h200.jsonl
done
el "start_tail done"
if [ -f /tmp/b-st/bundle.json ] && [ $(left) -gt 60 ]; then
  timeout $(( $(left) - 20 )) python3 benchmarks/handover_start.py --ckpt $C --bundle /tmp/b-st --out $L \
    --cache /tmp/cache_st --starts 5 --repeats 1 --modes aoti --tag _st > $L/handover_st.log 2>&1
  el "starts rc $?"; cat $L/handover_st.md 2>/dev/null || tail -3 $L/handover_st.log
  cp $L/handover_st.json $L/handover_st.md $OUT/ 2>/dev/null
fi
el done
