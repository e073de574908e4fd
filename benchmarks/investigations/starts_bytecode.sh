#!/bin/bash
# Session 34: the H200 image sets PYTHONDONTWRITEBYTECODE and its site-packages (torch's too) hold no bytecode, so
# every process there compiles each module it imports; a pip install leaves the bytecode written. Session 31's and
# this session's first `start_once.py` starts ran that way. Here, on one machine, interleaved, the same tree:
# first starts (an empty laya-aot cache each) and later starts with Python's bytecode cached (PYTHONPYCACHEPREFIX,
# written by one untimed start first), and later starts without it, as the image runs them.
# Needs C (checkpoint) and B (bundle) in the environment; writes $OUT/starts_bytecode_s34.txt.
# A dry run on the CPU: C=CKPT B=BUNDLE DEVICE=cpu OUT=DIR bash THIS
DEVICE=${DEVICE:-cuda}; N=${N:-4}
one() {  # label cache env...
  local t; t=$( { LAYA_AOT_CACHE_DIR=$2 LAYA_AOT_PRINT_FIRST_ANSWER=1 timeout 60 env "${@:3}" \
    python3 benchmarks/start_once.py bundle $C $B $DEVICE 2>&1 1>/dev/null; } \
    | grep -o 'first answer [0-9.]*' | grep -o '[0-9.]*$')
  echo "$1 ${t:-failed}" | tee -a $OUT/starts_bytecode_s34.txt
}
WITH="PYTHONPYCACHEPREFIX=/tmp/pyc-s34 PYTHONDONTWRITEBYTECODE="
WITHOUT="PYTHONDONTWRITEBYTECODE=1"
one warmup_untimed /tmp/sb-warm $WITH > /dev/null
for r in $(seq 1 $N); do one first_bytecode /tmp/sb-first$r $WITH; done
for r in $(seq 1 $N); do one later_bytecode /tmp/sb-first1 $WITH; one later_no_bytecode /tmp/sb-first1 $WITHOUT; done
