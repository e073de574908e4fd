#!/bin/bash
# device call D (session 29): thin_agent_gil.py on large-1024 (fp16 on disk), fresh processes, modes alternating;
# the first run makes the machine's tokenizer snapshot (not counted).
C=/tmp/laya-large-1024-fp16; export LAYA_AOT_CACHE_DIR=/tmp/cache_d
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('$C','large-1024',seed=0)" > /dev/null 2>&1
python3 benchmarks/investigations/thin_agent_gil.py $C alone > /dev/null 2>&1
for r in 1 2 3; do for m in alone beside cuda_only; do
  python3 benchmarks/investigations/thin_agent_gil.py $C $m 2>/dev/null | tee -a $OUT/thin_agent_gil_h200_s29.jsonl
done; done
