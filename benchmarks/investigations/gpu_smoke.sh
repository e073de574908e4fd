#!/usr/bin/env bash
# GPU smoke test (issue 5): why AOTInductor loads crash on the H200 image, and a tiny end-to-end CUDA bundle.
#   bash benchmarks/investigations/gpu_smoke.sh OUTDIR          (on the GPU host, after the .device-site unpack line)
set -u
OUT=${1:-/tmp/smoke}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch,sys;print('torch', torch.__version__, 'cuda', torch.version.cuda, 'abi', torch._C._GLIBCXX_USE_CXX11_ABI, 'python', sys.version.split()[0])"
  g++ --version | head -1; ls /usr/local/cuda/bin | tr '\n' ' '; echo; nproc; } > "$OUT/env.txt" 2>&1
# 1. the minimal reproducer, a few variants, in the background (16 cores)
timeout 420 python3 benchmarks/investigations/aoti_load_diag.py --out /tmp/diag \
  --only cpu_linear_default,cpu_linear_march_v2,cpu_linear_sysgomp_preload,cuda_linear_default,cuda_linear_march_v2,cuda_linear_nopch \
  > "$OUT/diag.txt" 2>&1 &
DIAG=$!
# 2. tiny end-to-end: build for the local GPU, inspect, load through the runtime (probe included)
python3 -m laya_aot.cli make-demo /tmp/tiny --shape tiny > /dev/null 2>&1
T0=$(date +%s.%N)
timeout 330 python3 -m laya_aot.cli build checkpoint.path=/tmp/tiny target=sm_90 stages.onnx=false \
  stages.tilelang=false output_dir=/tmp/bundle > "$OUT/build.txt" 2>&1; echo "build rc=$? wall=$(echo "$(date +%s.%N) - $T0" | bc)" >> "$OUT/build.txt"
cp /tmp/bundle/bundle.json "$OUT/bundle.json" 2>/dev/null
python3 -m laya_aot.cli inspect /tmp/bundle > "$OUT/inspect.txt" 2>&1
timeout 200 python3 - > "$OUT/load.txt" 2>&1 <<'PY'
import time, warnings, json
t0 = time.time()
import laya_aot
for prefer in (None, "aoti", "compile"):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = laya_aot.load("/tmp/tiny", bundle="/tmp/bundle", device="cuda", prefer=prefer)
    bo = a.backend_object
    r = a.predict_batch(["the server is down"], {"q": {"type": "noul", "instructions": "urgent?"}})
    print(json.dumps({"prefer": prefer, "backend": a.backend, "rejected": getattr(bo, "rejected", None),
                      "load_stats": getattr(bo, "load_stats", None) or getattr(bo, "stats", None),
                      "answer": r[0]["answers"]["q"]["noul"], "warnings": [str(x.message)[:400] for x in w],
                      "t": round(time.time() - t0, 2)}))
PY
wait $DIAG; cp /tmp/diag/summary.txt "$OUT/diag_summary.txt" 2>/dev/null
tail -n 30 "$OUT/build.txt"; cat "$OUT/load.txt" | cut -c1-1500; cat "$OUT/diag_summary.txt" 2>/dev/null | tail -n 40
