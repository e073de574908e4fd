"""How OpenMP's threads wait on the CPU, set once per process before torch is imported.

torch's CPU kernels and the AOTInductor packages' generated code run their parallel loops on one OpenMP pool
(libgomp). By default a thread that finishes its share of a loop spins a while for the next one; on a machine
whose cores other processes share, the spinning threads take the cores the pool's last thread needs, and every
parallel loop of a call waits for the scheduler. On a 2-core machine with two busy processes beside it, the demo's
`aoti-cpu-frozen` took a median 154 ms at 1x128x4 (10th to 90th percentile spread 1.29 s) where it takes 8 ms on
the idle machine; with OMP_WAIT_POLICY=PASSIVE (a waiting thread sleeps) 15 ms, spread 6 ms, and `aoti-cpu` the
same (benchmarks/results/cpu.md, "Threads on a busy machine"). ONNX Runtime's own pool is not OpenMP's: its figures
did not move either way.

`settle()` sets OMP_WAIT_POLICY=PASSIVE where the environment sets neither it nor GOMP_SPINCOUNT (an operator's
choice stands) and torch is not imported yet (libgomp reads it once, when it starts): the `laya-aot` command and
`laya_aot.load` call it first. A probe child inherits it, so it loads artifacts as the service runs them.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

log = logging.getLogger(__name__)

WAIT_POLICY = "PASSIVE"
_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def settle() -> Optional[str]:
    """Set OMP_WAIT_POLICY=PASSIVE for this process (module docstring); None once set, else why it was not."""
    given = [name for name in _SETTINGS if name in os.environ]
    if given:
        return "%s set by the environment" % ", ".join(given)
    if "torch" in sys.modules:
        log.debug("laya-aot: torch was imported before laya-aot could set OMP_WAIT_POLICY=%s; on a busy machine set "
                  "it before starting the process", WAIT_POLICY)
        return "torch was imported first"
    os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    return None
