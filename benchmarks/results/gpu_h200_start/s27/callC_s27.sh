#!/bin/bash
# device call C (session 27), on call A's machine: laya-aot serve over HTTP with the merged bundle of call B (load's
# default: it serves what the mix chooses) and laya serve (eager) on the same machine, two rounds each, 1/8/32
# clients (http_bench.py); run after the site unpack line and:
# { [ -d /tmp/site/fastapi ] || tar -xJf .device-site/serve-site.tar.xz -C /tmp/site; }
T0=$(date +%s)
el() { echo "[callC] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
L=/tmp/s27; uptime
timeout $(( $(left) - 10 )) python3 benchmarks/http_bench.py --device cuda --checkpoint /tmp/laya-large-1024-fp16 \
  --bundle /tmp/b-m --modes bundle,eager --rounds 2 --requests 300 --timeout 60 --out $L --tag cuda_h200_s27 \
  > $L/http_s27.log 2>&1
el "http rc $?"; tail -30 $L/http_s27.log; cat $L/http_cuda_h200_s27.md 2>/dev/null
cp $L/http_* $OUT/ 2>/dev/null; ls $OUT; uptime
