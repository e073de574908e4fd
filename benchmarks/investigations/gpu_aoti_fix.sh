#!/usr/bin/env bash
# Issue 5, AOTInductor load crash on the H200 image: which C++ toolchain built the crashing wrapper .so,
# and does a package built with another compiler load?   bash benchmarks/investigations/gpu_aoti_fix.sh OUTDIR
set -u
OUT=${1:-/tmp/fix}; mkdir -p "$OUT"
R="$OUT/report.txt"
{ echo "== toolchain"; which -a g++ c++ gcc; ls -la /opt/gcc/bin 2>&1 | head -20; echo "-- head of /opt/gcc/bin/g++:"
  head -c 1500 /opt/gcc/bin/g++ 2>&1 | strings | head -40; ls -la /usr/bin/g++* /usr/bin/x86_64-linux-gnu-g++* 2>&1
  python3 -c "import torch._inductor.config as c; print('cpp.cxx', c.cpp.cxx)"; } > "$R" 2>&1
ALT=""
for c in /usr/bin/x86_64-linux-gnu-g++-13 /usr/bin/g++-13 /usr/bin/g++; do
  if [ -x "$c" ] && [ "$(readlink -f $c)" != "$(readlink -f /opt/gcc/bin/g++)" ]; then ALT=$c; break; fi; done
echo "ALT_CXX=$ALT" >> "$R"
NO_GDB=1 ALT_CXX=$ALT timeout 300 python3 benchmarks/investigations/aoti_load_diag.py --out /tmp/d3 \
  --only cpu_linear_default,cpu_linear_altcxx,cuda_linear_altcxx >> "$R.diag" 2>&1
{ echo "== diag"; grep -v '^    #' /tmp/d3/summary.txt | cut -c1-400
  so=$(ls /tmp/d3/cpu_linear_default_load/tmp/aoti_x_*/model/data/aotinductor/model/*.so 2>/dev/null | head -1)
  [ -z "$so" ] && so=$(find /tmp/d3 -name '*.so' -path '*cpu_linear_default*' | head -1)
  echo "== crashing .so: $so"; readelf -d "$so" 2>&1 | grep -E 'NEEDED|RPATH|RUNPATH'
  echo "libstdc++ symbols defined inside it:"; nm -D --defined-only "$so" 2>/dev/null | grep -c 'St6locale\|codecvt\|regex'
  grep -h -E '^(g\+\+|/|.*-o .*\.so)' /tmp/d3/cpu_linear_default_build.log 2>/dev/null | head -3 | cut -c1-1500
} >> "$R" 2>&1
cat "$R"
