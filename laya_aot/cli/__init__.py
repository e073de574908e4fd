"""The `laya-aot` command: build (Hydra), demo, inspect, bench, verify, make-demo.

Arguments are checked before anything heavy loads (`usage.py`: a typo fails in a fraction of a second,
with the fix). `laya-aot build` then hands its arguments to Hydra unchanged, so every Hydra feature works:
overrides (`export.max_rows=128`), config groups (`checkpoint=laya target=sm_90`), `--config-dir`
for a user's own configs, `--cfg job` to print the resolved config; `--help` is laya-aot's own
(`build_help.py`), `--hydra-help` Hydra's.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from typing import List, Optional

from .._version import __version__
from ..distribution import HF_SCHEME

START = time.perf_counter()
# where each job of `laya-aot build -m ...` writes when output_dir is unset: one partial bundle per
# checkpoint x target, joined by `laya-aot merge artifacts/NAME artifacts/parts/NAME/*`
MULTIRUN_OUTPUT = "artifacts/parts/{checkpoint}/{target}"
COMMANDS = ("build", "demo", "inspect", "bench", "verify", "make-demo", "serve", "merge", "pack", "unpack", "fetch")
USAGE = """usage: laya-aot [--version] COMMAND [--quiet] [ARGS]

  build [HYDRA OVERRIDES]        build a verified bundle (default: the demo checkpoint, target cpu)
  demo [--bundle DIR]            build the demo bundle if missing, load it, answer typed questions
  inspect BUNDLE [--json]        list a bundle's artifacts and whether each is usable on this machine
  bench BUNDLE [--rounds N]      time the artifacts usable here: laya_aot.load here then ranks by it
  verify BUNDLE --checkpoint DIR re-check hashes and re-run the numerical verification here
  make-demo DIR [--shape S]      write a demo checkpoint (tiny, tiny-alt, base-512, large-1024, ...)
  serve                          laya's HTTP server, bundled checkpoints loaded from LAYA_AOT_BUNDLES
  merge OUT BUNDLE...            join partial bundles of one checkpoint (built on several machines)
  pack BUNDLE FILE.tar.zst       write a bundle as one zstd tar, manifest first
  unpack FILE DIR                extract a pack, checking every file against its manifest
  fetch SPEC [--device D]        fetch what this machine can use: hf://ORG/REPO[/PATH][@REV], a pack, a dir of packs

`laya-aot COMMAND --help` describes a command's arguments; `laya-aot build --help` lists the config groups and
every key. --quiet: no live progress lines (they show only on a terminal)."""


def _setup_logging(verbose: bool = False) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(show_path=False, show_time=False)], force=True)


def _build(argv: List[str]) -> int:
    """`laya-aot build`; Ctrl-C is one line: the staging transaction has already discarded what was half made."""
    try:
        return _hydra_build(argv)
    except KeyboardInterrupt:
        print("laya-aot build: interrupted; nothing was published (what was at the output is unchanged)",
              file=sys.stderr)
        return 130


def _hydra_build(argv: List[str]) -> int:
    if "-h" in argv or "--help" in argv:
        from .build_help import text

        print(text())
        return 0
    if "--hydra-help" in argv:
        argv = [("--help" if a == "--hydra-help" else a) for a in argv]
    import hydra
    from omegaconf import DictConfig
    from rich.markup import escape

    from ..config import register
    from ..pipeline.report import Reporter, summary_table
    from .usage import with_implied

    register()
    sys.argv = ["laya-aot build"] + with_implied(argv)
    status = {"code": 0}

    @hydra.main(version_base="1.3", config_path="configs", config_name="build")
    def _main(cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from ..pipeline import BuildError, build

        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        # a launcher may run the job in another process (Ray, SLURM): relative paths mean the caller's directory
        if os.getcwd() != hc.runtime.cwd:
            os.chdir(hc.runtime.cwd)
        if multirun and cfg.output_dir is None:  # one partial bundle per job, for `laya-aot merge`
            cfg.output_dir = MULTIRUN_OUTPUT
        _setup_logging(bool(os.environ.get("LAYA_AOT_VERBOSE")))
        # torch's exporters warn about their own internals (pytree, online softmax); the stage table says
        # what matters. LAYA_AOT_VERBOSE=1 shows them.
        if not os.environ.get("LAYA_AOT_VERBOSE"):
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
        with Reporter() as rep:
            try:
                result = build(cfg, report=rep.update)
            except BuildError as e:
                rep.console.print("[bold red]build failed:[/] %s" % escape(str(e)), soft_wrap=True)  # one line
                if multirun:  # the launcher runs the other jobs, then reports this one and exits non-zero
                    raise BuildError(str(e)) from None
                status["code"] = 2
                return
        rep.console.print(summary_table(result.bundle, result.output_dir))
        rep.console.print("bundle written to [bold]%s[/] in %.1f s" % (result.output_dir,
                                                                     time.perf_counter() - START))

    _main()
    return status["code"]


def main(argv: Optional[List[str]] = None) -> int:
    """The `laya-aot` command. A reader that stops early (`laya-aot build --help | head -3`) ends it quietly
    with the status a shell gives a command its pipe closed on (141), not a traceback."""
    try:
        return _dispatch(argv)
    except BrokenPipeError:
        if not _stdout_reader_gone():  # another pipe or socket broke (a child, a connection): a real error
            raise
        # Python's documented recipe: stdout points at devnull, so the interpreter's exit flush cannot raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or stdout is not a file descriptor
        return False


def _dispatch(argv: Optional[List[str]]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        print("laya-aot %s" % __version__)
        return 0
    cmd, rest = argv[0], argv[1:]
    from ..kinds.cpu_threads import settle

    settle()  # before torch is imported (every command): CPU threads that do not collapse on a busy machine
    if cmd not in COMMANDS:
        import difflib

        near = difflib.get_close_matches(cmd, COMMANDS, n=1)
        print("laya-aot: unknown command %r%s\n\n%s" % (cmd, "; did you mean `%s`?" % near[0] if near else "", USAGE),
              file=sys.stderr)
        return 2
    if "--quiet" in rest:  # every command: no live progress lines (nor in the processes it starts)
        from .. import progress

        progress.set_quiet()
        os.environ["LAYA_AOT_QUIET"] = "1"
        rest = [a for a in rest if a != "--quiet"]
    if "-h" not in rest and "--help" not in rest:
        # before any heavy import: one line naming the mistake and its fix
        from .usage import mistake

        why = mistake(cmd, rest)
        if why:
            print("laya-aot %s: %s" % (cmd, why), file=sys.stderr)
            return 2
    if cmd == "build":
        return _build(rest)
    _setup_logging()
    if cmd == "serve":
        from ..serve import main as serve_main

        return serve_main(rest, START)
    if cmd == "fetch" and any(a.startswith(HF_SCHEME) for a in rest):
        from .hub_reach import unreachable

        why = unreachable()
        if why:  # one line, then the local cache only: not a minute of retries, each logged twice
            os.environ["HF_HUB_OFFLINE"] = "1"
            print("laya-aot fetch: the Hugging Face Hub cannot be reached: %s; using the local cache only" % why,
                  file=sys.stderr)
    if cmd in ("merge", "pack", "unpack", "fetch"):
        from ..distribution import commands as dist

        return getattr(dist, cmd)(rest, START)
    from .. import commands

    if cmd == "make-demo":
        from ..demo import main as demo_main

        return commands._guarded("make-demo", lambda: demo_main(rest))

    return {"demo": commands.demo, "inspect": commands.inspect, "bench": commands.bench,
            "verify": commands.verify}[cmd](rest, START)

