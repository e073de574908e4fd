#!/bin/bash
# device call D (session 19): the attention kernel alone at a short call's shapes, each tile configuration replayed
# from a CUDA graph (the 1x1 call's forward spends about 8 us a layer in it, session 17's profile)
T0=$(date +%s)
timeout 200 python3 benchmarks/attention_ab.py --out $OUT --tag _graph_s19 --kernel-only --graph \
  --kernel-shapes 1x80,1x128,1x256,8x256,32x1024 > $OUT/attention_graph_s19.log 2>&1
echo "[callD] $(( $(date +%s) - T0 )) s: rc $?"
tail -5 $OUT/attention_graph_s19.log
