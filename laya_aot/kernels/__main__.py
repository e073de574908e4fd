"""Command line: list a checkpoint's kernel catalogue, or cross-compile it per architecture.

    python -m laya_aot.kernels catalogue CKPT [--max-len N] [--max-rows N] [--dtype bf16]
    python -m laya_aot.kernels build CKPT --arch sm_80 --arch sm_90a --out DIR [--jobs N] [--report FILE]
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path
from typing import List, Optional

from ..numerics.precision import cuda_dtype
from .cross_compile import (
    DEFAULT_ARCHS,
    build_for_checkpoint,
    checkpoint_catalogue,
    default_jobs,
    read_checkpoint_config,
)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--dtype", default=None, help="bf16 or fp16 (default: what laya serves the checkpoint in on "
                   "sm_80+: its amp_dtype, fp16 when absent)")
    p.add_argument("--max-len", type=int, default=None, help="default: the checkpoint's max_len")
    p.add_argument("--max-rows", type=int, default=64)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m laya_aot.kernels", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    _common(sub.add_parser("catalogue", help="print the kernel keys"))
    b = sub.add_parser("build", help="cross-compile the catalogue")
    _common(b)
    b.add_argument("--arch", action="append", default=None, help="repeatable; default %s" % ",".join(DEFAULT_ARCHS))
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--jobs", type=int, default=None)
    b.add_argument("--report", type=Path, default=None, help="also write a JSON summary here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("TileLang").setLevel(logging.WARNING)
    if a.cmd == "catalogue":
        for spec in checkpoint_catalogue(a.checkpoint, a.dtype, a.max_len, a.max_rows):
            print(spec.key)
        return 0
    agent_cfg = read_checkpoint_config(a.checkpoint)["agent"]
    dtype = a.dtype or cuda_dtype(agent_cfg.get("amp_dtype"))
    max_len = a.max_len or int(agent_cfg.get("max_len", 512))
    t0 = time.perf_counter()
    reports = build_for_checkpoint(a.checkpoint, a.arch or list(DEFAULT_ARCHS), dtype, max_len, a.max_rows, a.out,
                                   jobs=a.jobs)
    summary = {"dtype": dtype, "max_len": max_len, "max_rows": a.max_rows,
               "command": " ".join(["python -m laya_aot.kernels"] + (argv if argv is not None else sys.argv[1:])),
               "host": {"cpus": default_jobs(), "machine": platform.machine(), "python": platform.python_version()},
               "wall_seconds": round(time.perf_counter() - t0, 1),
               "archs": {arch: {k: r[k] for k in ("seconds", "ok", "failed", "jobs", "tilelang_version", "laya_version",
                                                  "nvcc_version")}
                         | {"kernels": len(r["kernels"]),
                            "bytes": sum(e["size"] or 0 for e in r["kernels"]),
                            "kernel_seconds_sum": round(sum(e["seconds"] for e in r["kernels"]), 1),
                            "failures": {e["key"]: (e["error"] or "")[:2000]
                                         for e in r["kernels"] if e["status"] != "ok"}}
                         for arch, r in reports.items()}}
    print(json.dumps(summary, indent=1))
    if a.report:
        a.report.parent.mkdir(parents=True, exist_ok=True)
        a.report.write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(r["failed"] == 0 for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
