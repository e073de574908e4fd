#!/bin/bash
# Session 36's device calls, each after the site unpack line of shared/gpu/README.md (the slim site of
# benchmarks/make_slim_site.sh, carried as .device-site/site.tar.xz). Not meant to be run as one script.

# call 1 (H200, fresh machine, main 53b7925): build large-1024 AOTInductor-only, the graph-copies A/B, HTTP, OOM, profile
BUDGET=570 bash benchmarks/investigations/serve_oom_s35.sh
#   returned only 8 files (the tool's limit); the OOM and profile outputs were lost, so call 2 re-ran those two

# call 2 (the same warm H200 machine, main 53b7925), with C=/tmp/laya-large-1024-fp16 B=/tmp/b-s32 from call 1:
python3 -m laya_aot.cli inspect $B > inspect_s36.txt
python3 benchmarks/investigations/oom_thin_agent.py $C $B ../gpu_h200_oom/call_s36_h200_main_53b7925_full.json --phases full
python3 benchmarks/gpu_profile.py --out . --ckpt $C --bundle $B --device cuda --shape large-1024 --paths bundle \
  --repeats 15 --tag _s35

# call 3 (an H100 came, fresh machine; the tree of fa3b7de's code, before its tests and docs), call 1's bundle
# carried as .gpu_bundle/b-s32.tgz (1.6 MB: the weights are the checkpoint's), the checkpoint made again (seed 0):
python3 benchmarks/investigations/oom_thin_agent.py $C $B ../gpu_h200_oom/call_s36_h100_retry_fix.json
python3 benchmarks/investigations/graph_copies_ab.py $C $B ../gpu_h100_s36/graph_copies_ab_s36.json   # at 53b7925
python3 benchmarks/http_bench.py --device cuda --checkpoint $C --bundle $B --modes bundle --rounds 3 --requests 300 \
  --timeout 60 --out ../gpu_h100_s36 --tag s36

# call 4 (an H100 came, fresh machine; main b08464a's tree), call 1's bundle carried as in call 3, the checkpoint
# made again: starts and the three calls as a service times them, laya eager in the same run
python3 benchmarks/gpu_start.py --out ../gpu_h100_s36 --ckpt $C --bundle $B --starts 2 --bytecode /tmp/pyc --tag _s36
