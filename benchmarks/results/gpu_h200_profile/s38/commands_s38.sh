#!/bin/bash
# Session 38's device calls (eight: calls 1-3 and 5-8 on H100s, call 4 on an H200), each after the slim site's unpack line
# (benchmarks/make_slim_site.sh):
#   mkdir -p /tmp/site && { [ -d /tmp/site/fastapi ] || tar -xJf .device-site/site.tar.xz -C /tmp/site; } \
#     && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Not meant to be run as one script. Main at b668ef5 (call 1), plus the new investigation script (calls 2-3).

# call 1 (session 37's prepared call): session 36's bundle's package as `table` (built at 53b7925; the export code
# is unchanged since), `table+splitmlp` and `table+splitmlp+autotune+tma` compiled side by side. The tuned package
# was still tuning when the one compile deadline (400 s) ended it (rc -9, call1_*_autotune_tma.log: its last 20,000
# characters); the other two ran every shape (call1_*).
tar -xzf .gpu_bundle/b-s32.tgz -C /tmp
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)"
C=/tmp/laya-large-1024-fp16
timeout 540 python3 benchmarks/aoti_variants.py --ckpt $C --out $OUT --tag _s38 \
  --variants table,table+splitmlp,table+splitmlp+autotune+tma --prebuilt table=/tmp/b-s32/aoti-sm_90 --smoke \
  --compile-timeout 400 --shapes 1x80,1x128,8x256,32x512,32x1024 > $OUT/run_s38.log 2>&1

# call 2: the GeGLU block alone, today's form against the split form under max-autotune (call2_*; this call's
# Markdown table has the script's first column names: "split, tuned" is today's "tuned (`split`)")
timeout 470 python3 benchmarks/investigations/geglu_epilogue_ab.py --out $OUT --tag _s38 --budget-s 330 \
  > $OUT/geglu_s38.log 2>&1

# call 3: the residual add after the MLP's Wo and the next layer norm, without and with max-autotune (call3_*)
timeout 400 python3 benchmarks/investigations/geglu_epilogue_ab.py --block residual --out $OUT --tag _s38 \
  --budget-s 300 > $OUT/residual_s38.log 2>&1

# call 4 (an H200): calls 2 and 3 again on the GPU issue 24 names (call4_*)
timeout 280 python3 benchmarks/investigations/geglu_epilogue_ab.py --out $OUT --tag _s38h200 --budget-s 220 \
  > $OUT/geglu_s38h200.log 2>&1
timeout 200 python3 benchmarks/investigations/geglu_epilogue_ab.py --block residual --out $OUT --tag _s38h200 \
  --budget-s 150 > $OUT/residual_s38h200.log 2>&1

# calls 5-7 (H100s; call 5 asked for an H200 and got an H100, its files renamed from _s38h200 to _s38a): a
# hand-written persistent TMA kernel for Wi with the GeGLU in its epilogue, three sets of tile settings (call5-7_*)
python3 benchmarks/investigations/geglu_tma.py --check
timeout 300 python3 benchmarks/investigations/geglu_tma.py --out $OUT --tag _s38h200 --budget-s 220 \
  > $OUT/geglu_tma_s38h200.log 2>&1
timeout 200 python3 benchmarks/investigations/geglu_tma.py --set b --tokens 16384,4096 --out $OUT --tag _s38b \
  --budget-s 150 > $OUT/geglu_tma_s38b.log 2>&1
python3 benchmarks/investigations/geglu_tma.py --check
timeout 200 python3 benchmarks/investigations/geglu_tma.py --set c --tokens 16384,4096 --out $OUT --tag _s38c \
  --budget-s 150 > $OUT/geglu_tma_s38c.log 2>&1

# call 8 (an H100), at commit dc25d2d (the kernel's WS switch and --warp-specialised existed only there; the next
# commit took them out): the attention kernel alone, the shipped tiles with Triton's warp-specialised key loop
timeout 170 python3 benchmarks/attention_ab.py --kernel-only --graph --warp-specialised \
  --kernel-shapes 32x1024,8x256,1x128 --out $OUT --tag _s38ws > $OUT/attention_ws_s38.log 2>&1
