"""`laya-aot merge`, `pack`, `unpack` and `fetch`: the distribution commands a CI job or a person runs.

Each prints what it did, and a refusal as one `laya-aot CMD: ...` line on stderr with exit status 2.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, List

from ..manifest import BundleError
from . import HF_SCHEME


def _run(name: str, argv: List[str], setup: Callable[[argparse.ArgumentParser], None],
         body: Callable[[argparse.Namespace], None]) -> int:
    p = argparse.ArgumentParser(prog="laya-aot %s" % name)
    setup(p)
    a = p.parse_args(argv)
    try:
        body(a)
    except BundleError as e:
        print("laya-aot %s: %s" % (name, e), file=sys.stderr)
        return 2
    except OSError as e:  # a read-only target, a full disk, a directory it may not enter: one line, no traceback
        print("laya-aot %s: %s" % (name, os_error(e)), file=sys.stderr)
        return 2
    return 0


def _device(value: str) -> str:
    from ..variant import check_device

    try:
        return check_device(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def os_error(e: OSError) -> str:
    """An OSError as one line naming the path and the fix."""
    where = " %s" % e.filename if e.filename else ""
    return ("cannot use%s (%s); check that the path exists, that you may read and write it, and the free space"
            % (where, e.strerror or e))


def merge(argv: List[str], start: float) -> int:
    def setup(p: argparse.ArgumentParser) -> None:
        p.description = "Join partial bundles of one checkpoint (built on different machines) into one bundle."
        p.add_argument("out", type=Path, help="the merged bundle's directory (absent, empty, or a bundle)")
        p.add_argument("bundles", type=Path, nargs="+", help="the partial bundles")
        p.add_argument("--overwrite", action="store_true", help="replace OUT even if laya-aot did not write it")

    def body(a: argparse.Namespace) -> None:
        from .merge import merge as do

        t0 = time.perf_counter()
        b = do(a.out, a.bundles, overwrite=a.overwrite)
        print("merged %d bundles into %s in %.1f s: %d artifacts" % (len(a.bundles), a.out,
                                                                    time.perf_counter() - t0, len(b.artifacts)))
        for art in b.artifacts:
            print("  %-28s %-10s %-12s built on %s" % (art.name, art.status, art.variant,
                                                        _machine(art.build_machine)))

    return _run("merge", argv, setup, body)


def _machine(m: dict) -> str:
    if not m:
        return "?"
    return "%s %s%s" % (m.get("machine"), m.get("cpu_isa"), " + %s" % m["gpu_arch"] if m.get("gpu_arch") else "")


def pack(argv: List[str], start: float) -> int:
    def setup(p: argparse.ArgumentParser) -> None:
        p.description = "Write a bundle as one zstd-compressed tar, bundle.json first."
        p.add_argument("bundle", type=Path, help="the bundle directory to pack (the one holding bundle.json)")
        p.add_argument("file", type=Path, help="the pack to write, e.g. demo.tar.zst")
        p.add_argument("--overwrite", action="store_true", help="replace FILE even if it is not a pack")

    def body(a: argparse.Namespace) -> None:
        from .pack import pack as do

        info = do(a.bundle, a.file, overwrite=a.overwrite)
        print("packed %s into %s: %d files, %d bytes, sha256 %s" % (a.bundle, info.path, info.files, info.size,
                                                                    info.sha256))

    return _run("pack", argv, setup, body)


def unpack(argv: List[str], start: float) -> int:
    def setup(p: argparse.ArgumentParser) -> None:
        p.description = "Extract a pack into a bundle directory, checking every file against its manifest."
        p.add_argument("file", type=Path, help="the pack to read (written by `laya-aot pack`)")
        p.add_argument("dir", type=Path, help="the bundle directory to create (absent, empty, or a bundle)")
        p.add_argument("--overwrite", action="store_true", help="replace DIR even if laya-aot did not write it")

    def body(a: argparse.Namespace) -> None:
        from .pack import unpack as do

        b = do(a.file, a.dir, overwrite=a.overwrite)
        print("unpacked %s into %s: %d artifacts" % (a.file, a.dir, len(b.artifacts)))

    return _run("unpack", argv, setup, body)


def fetch(argv: List[str], start: float) -> int:
    def setup(p: argparse.ArgumentParser) -> None:
        p.description = ("Fetch what this machine can use of a bundle: hf://ORG/REPO[/PATH][@REVISION], a pack "
                         "(*.tar.zst) or a directory of packs.")
        p.add_argument("spec", help="hf://ORG/REPO[/PATH][@REVISION], a pack file, or a directory of packs")
        p.add_argument("--device", default=None, type=_device,
                       help="the device the agent will run on: cpu, cuda or cuda:N (default: cuda if visible)")
        p.add_argument("--out", type=Path, default=None, help="put the bundle here instead of the laya-aot cache")
        p.add_argument("--overwrite", action="store_true", help="replace --out even if laya-aot did not write it")

    def body(a: argparse.Namespace) -> None:
        from .fetch import fetch as do

        f = do(a.spec, device=a.device, out=a.out, overwrite=a.overwrite)
        print("fetched %s into %s" % (f.source, f.path))
        print("  artifacts usable here: %s" % (", ".join(f.fetched) or "none"))
        if f.files:
            print("  files: %d (%d bytes)%s" % (f.files, f.bytes, ", %d downloaded, the rest from the Hugging Face "
                                                "cache" % f.downloaded if f.source.startswith(HF_SCHEME) else ""))
        for name, why in f.skipped:
            print("  not fetched: %s: %s" % (name, why))

    return _run("fetch", argv, setup, body)
