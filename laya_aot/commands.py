"""`laya-aot demo`, `inspect` and `verify`: the commands a person runs against a bundle."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import progress
from .bundle_format import bundle_sha256, check_artifact_hash, read_bundle
from .demo.training import QUESTIONS as DEMO_QUESTIONS
from .manifest import MANIFEST, Artifact, BundleError

log = logging.getLogger(__name__)

DEMO_BUNDLE = "artifacts/demo"

# held out: no synthetic ticket the demo model was trained on is one of these (demo/training.py)
DEMO_STATES = [
    "I was charged twice for the March invoice, please refund the second payment.",
    "The service has been down since this morning and nobody in the office can log in!",
    "Please reset my password, I forgot it after the holidays.",
]


DEMO_LEGEND = """\
This is a small demo model, trained for about a minute on synthetic support tickets: it knows these three
questions and little else. A checkpoint of yours goes through the same build, load and answers.
  team (choice)    the option picked, and its probability (0-1): the team this message goes to
  urgency (score)  the expected level on the question's scale: 0 = not urgent ... 3 = critical, act now
  angry (noul)     "noul" is laya's yes/no question type: the probability (0-1) that the statement is true"""


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 140)


def _demo_checkpoint() -> Path:
    from .config import CheckpointConfig
    from .demo import DEMO_SHAPE, resolve

    return resolve(CheckpointConfig(name="demo", demo_shape=DEMO_SHAPE))


def demo(argv: List[str], start: float) -> int:
    p = argparse.ArgumentParser(prog="laya-aot demo", description="Build the demo bundle if missing, load it, "
                                "answer a few typed questions.")
    p.add_argument("--bundle", default=DEMO_BUNDLE, metavar="DIR",
                   help="the bundle to load; built here first when it has no bundle.json (default: %(default)s)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="the Laya checkpoint the bundle is built from (default: the built-in demo checkpoint, "
                   "made and trained here on first use)")
    p.add_argument("--device", default="cpu", type=device_arg, help="the device the agent runs on: cpu, cuda, "
                   "cuda:1 (default: %(default)s)")
    a = p.parse_args(argv)
    return _guarded("demo", lambda: _demo(a, start))


def _demo(a: argparse.Namespace, start: float) -> int:
    con = _console()
    t0 = time.perf_counter()
    ckpt = Path(a.checkpoint) if a.checkpoint else _demo_checkpoint()
    # part of this run's time to its first answer, shown apart: the demo checkpoint (trained on first use, checked
    # against its record after) and the bundle (built when missing)
    apart = {"finding or making the demo checkpoint": time.perf_counter() - t0}
    if not (Path(a.bundle) / MANIFEST).exists():
        con.print("no bundle at %s: building it (laya-aot build output_dir=%s)" % (a.bundle, a.bundle))
        t0 = time.perf_counter()
        args = [sys.executable, "-m", "laya_aot.cli", "build", "output_dir=%s" % a.bundle]
        if a.checkpoint:
            args.append("checkpoint.path=%s" % a.checkpoint)
        rc = subprocess.call(args)
        if rc != 0:
            con.print("[red]the build failed (exit %d); see its output above[/]" % rc)
            return rc
        apart["building the bundle"] = time.perf_counter() - t0
    import laya_aot

    t_load = time.perf_counter()
    agent = laya_aot.load(str(ckpt), bundle=a.bundle, device=a.device)
    loaded = time.perf_counter()
    results = agent.predict_batch(DEMO_STATES, DEMO_QUESTIONS)
    first = time.perf_counter()
    age = process_age_s(start)  # read at once: what is printed is this process's time to its first answer
    parts = ["%s %.2f s" % (what, seconds) for what, seconds in apart.items() if seconds >= 0.05]
    con.print("first answer [bold]%.2f s[/] after the process started; %sloading the bundle %.2f s, the first "
              "predict_batch %.3f s" % (age, "of it %s; " % ", ".join(parts) if parts else "", loaded - t_load,
                                         first - loaded), soft_wrap=True)
    sys.stdout.flush()
    t = Table(title="decisions (backend %s)" % agent.backend)
    for col in ("state", "team", "urgency (score)", "angry (noul)"):
        t.add_column(col)
    for state, r in zip(DEMO_STATES, results):
        ans = r["answers"]
        t.add_row(state[:48] + ("..." if len(state) > 48 else ""),
                  "%s (%.2f)" % (ans["team"]["choice"], ans["team"]["answer_confidence"]),
                  "%.2f" % ans["urgency"]["score"], "%.2f" % ans["angry"]["noul"])
    con.print(t)
    if not a.checkpoint:
        con.print(DEMO_LEGEND, soft_wrap=True)
    bo = agent.backend_object
    art = getattr(bo, "artifact", None)
    con.print("backend: [bold]%s[/]  artifact: %s  variant: %s" % (agent.backend, art.name if art else None,
                                                                   getattr(bo, "variant", None)))
    for name, why in _not_used(Path(a.bundle), agent):
        con.print("  not used: %s: %s" % (name, why), soft_wrap=True)
    return 0


def process_age_s(start: float) -> float:
    """Seconds since this process was started (the kernel's start time, Linux, 10 ms ticks: the interpreter's own
    start and imports included); elsewhere since `start`, the command line's first moment."""
    from .staging import start_ticks

    ticks = start_ticks(os.getpid())
    if ticks is None or not hasattr(time, "CLOCK_BOOTTIME"):
        return time.perf_counter() - start
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


def _not_used(bundle: Path, agent: Any) -> List[Any]:
    """(name, reason) of each artifact not serving `agent`: the load's reasons, and the artifacts it never examined
    (it stops at the first that serves) that this process's software refuses (`usable.refused_for_software`)."""
    from . import kinds
    from .kinds.usable import here_for, refused_for_software

    bo = agent.backend_object
    rejected = list(getattr(bo, "rejected", None) or [])
    art = getattr(bo, "artifact", None)
    if art is None:
        return rejected  # a fall-back examined every artifact
    examined = {art.name} | {name for name, _ in rejected}
    try:
        m = read_bundle(bundle, kinds.BY_NAME)
    except BundleError:
        return rejected
    return rejected + refused_for_software([e for e in m.artifacts if e.name not in examined],
                                           here_for(m, str(agent.device)))


def _usable_here(bundle: Path, art: Artifact, here) -> str:
    """'usable', or why not: the loader's first check (`usable.Here.reject_reason`), then the artifact's hash."""
    why = here.reject_reason(art) or (check_artifact_hash(bundle, art) if art.built else None)
    return "usable" if why is None else why


def _probe_here(art: Artifact, here) -> Optional[str]:
    """What a start here does about a native artifact's probe child (`probe.cached_verdict`): "cached" (an earlier
    start here probed it), "shipped" (the build's verdict fits this machine: a start that pins the bundle runs no
    child, an unpinned one does) or "child" (one runs on the first start); None for kinds without one."""
    from . import kinds
    from .probe import cached_verdict, shipped_verdict

    if not art.built or not kinds.get(art.kind).native:
        return None
    if cached_verdict(art, here.machine, here.device) is not None:
        return "cached"
    return "shipped" if shipped_verdict(art, here.machine, here.device) is not None else "child"


def _guarded(name: str, run: Callable[[], int]) -> int:
    """Run a command; anything unforeseen is one line naming it (exit 2), never a traceback. A bundle's
    problems are reported by the command itself; this catches what nobody foresaw."""
    try:
        return run()
    except KeyboardInterrupt:
        return 130
    except (BundleError, FileExistsError) as e:  # a refusal that already names its cause and fix
        print("laya-aot %s: %s" % (name, e), file=sys.stderr)
        return 2
    except OSError as e:  # permissions, a read-only target, a full disk: expected, one line
        from .distribution.commands import os_error

        print("laya-aot %s: %s" % (name, os_error(e)), file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one line for the person at the terminal; --debug shows the rest
        log.debug("laya-aot %s failed", name, exc_info=True)
        print("laya-aot %s: %s: %s (internal error: please report it; LAYA_AOT_VERBOSE=1 shows where)"
              % (name, type(e).__name__, str(e)[:500]), file=sys.stderr)
        if os.environ.get("LAYA_AOT_VERBOSE"):
            import traceback

            traceback.print_exc()
        return 2


def inspect(argv: List[str], start: float) -> int:
    p = _bundle_parser("inspect", "List a bundle's artifacts and whether each is usable on this machine.")
    p.add_argument("--json", action="store_true", help="print the same facts as JSON (for scripts)")
    a = p.parse_args(argv)
    return _guarded("inspect", lambda: _inspect(a))


def _bundle_parser(command: str, description: str, device: bool = True) -> argparse.ArgumentParser:
    """`laya-aot COMMAND BUNDLE`'s parser, with --device where the command runs artifacts here."""
    p = argparse.ArgumentParser(prog="laya-aot %s" % command, description=description)
    p.add_argument("bundle", help="the bundle directory (the one holding bundle.json)")
    if device:
        p.add_argument("--device", default=None, type=visible_device_arg,
                       help="the agent's device: cpu, cuda or cuda:N (default: cuda when visible, else cpu)")
    return p


def visible_device_arg(value: str) -> str:
    """`device_arg`, and a device this process can see: what a command says or runs for a device it cannot see
    would be about another machine (its GPU's facts are not known here)."""
    v = device_arg(value)
    if v.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(v.partition(":")[2] or 0) >= count:
            raise argparse.ArgumentTypeError(
                "%s is not visible here (%s); run the command on the GPU machine, or leave --device out"
                % (v, "no CUDA device" if count == 0 else "%d CUDA device%s" % (count, "s" * (count > 1))))
    return v


def device_arg(value: str) -> str:
    """--device as argparse checks it: a message naming the option, not an internal error."""
    from .variant import check_device

    try:
        return check_device(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _inspect(a: argparse.Namespace) -> int:
    from . import kinds
    from .kinds.usable import here_for

    try:
        raw_sha = bundle_sha256(a.bundle)
        m = read_bundle(a.bundle, kinds.BY_NAME, sha256=raw_sha)
    except BundleError as e:
        print("laya-aot inspect: %s" % e, file=sys.stderr)
        return 2
    here = here_for(m, a.device)
    device, machine, dev_type, serving = here.device, here.machine, here.device_type, here.serving
    rows = []
    for e in m.artifacts:
        v = e.verify
        eager = v.eager_in_dtype if v else None
        rows.append({"name": e.name, "kind": e.kind, "variant": e.variant, "dtype": e.dtype,
                     "size": e.size, "status": e.status,
                     "max_abs_option_prob": v.max_abs_option_prob if v else None,
                     "max_abs_action_prob": v.max_abs_action_prob if v else None,
                     "argmax_agreement": v.argmax_agreement if v else None,
                     "tolerance": v.tolerance if v else None, "rule": v.rule if v else None,
                     "eager_in_dtype": dataclasses.asdict(eager) if eager else None,
                     "tie_margin": v.tie_margin() if v else None,
                     "decisions": dataclasses.asdict(v.decisions) if v and v.decisions else None,
                     "precision": dataclasses.asdict(e.precision) if e.precision else None,
                     "latency_ms": e.latency_ms, "latency_spread_ms": e.latency_spread_ms,
                     "needs_torch": e.needs.torch if e.needs else None,
                     "here": _usable_here(Path(a.bundle), e, here), "probe_here": _probe_here(e, here)})
    torch_line = _torch_needed(m.artifacts, machine.torch)
    serves = _would_serve(m.artifacts, rows, here, raw_sha)
    if a.json:
        from rich.text import Text

        print(json.dumps({"bundle": a.bundle, "bundle_sha256": raw_sha, "checkpoint": m.checkpoint.name,
                          "machine": machine.as_dict(), "device": device, "serving_dtype": serving,
                          "artifacts": rows, "torch_needed": torch_line,
                          "would_serve": {"artifact": serves.artifact, "why": Text.from_markup(serves.text).plain}},
                         indent=2))
        return 0
    con = _console()
    title = ("%s (checkpoint %s, built %s; laya serves it in %s on %s here)"
             % (a.bundle, m.checkpoint.name, m.created, serving, dev_type))
    if con.is_terminal and con.width >= TABLE_WIDTH:
        con.print(_artifact_table(title, rows, m.artifacts))
    else:
        con.print(_artifact_list(title, rows, m.artifacts) + "\n", soft_wrap=not con.is_terminal)
    con.print("dtype: what the agents it serves run in, and how it computes (faithful: fp32 but for the matrix "
              "products, in the dtype named; laya: as laya serves). decisions: a 16-bit artifact's top options "
              "agreeing with fp32's on the seeded decision suite and on its near ties (rows whose fp32 top two "
              "options are within the 16-bit error), beside laya's eager forward's in the dtype its products run in "
              "(and as laya serves, where that differs; p: the one-sided exact McNemar test of each part, %s). "
              "near-tie margin: "
              "with near_ties=\"call\" or \"rows\" (off by default), a row whose top two option probabilities "
              "are closer than this is answered by laya's eager forward" % "artifact fails below alpha",
              soft_wrap=True)
    con.print("bundle sha256 (pin it with laya_aot.load(..., bundle_sha256=...) or LAYA_AOT_BUNDLE_SHA256): %s"
              % raw_sha, soft_wrap=True)
    if torch_line:
        con.print(torch_line, soft_wrap=True)
    probed = {r["name"]: r["probe_here"] for r in rows if r["here"] == "usable" and r["probe_here"]}
    if probed:
        con.print("probe child (native artifacts, on a start here): %s" % ", ".join(
            "%s %s" % (name, _PROBE_WORDS[state]) for name, state in probed.items()), soft_wrap=True)
    con.print("on this machine `load()` would serve: %s" % serves.text, soft_wrap=True)
    return 0


def _torch_needed(artifacts: List[Artifact], here: str) -> Optional[str]:
    """Which torch the bundle's serving artifacts need where they serve, and how an environment gets it (None: none
    is tied to one)."""
    from . import kinds
    from .variant import torch_tag

    by_torch: Dict[str, List[str]] = {}
    for e in artifacts:
        if e.built and not e.invalid and e.needs.torch and kinds.get(e.kind).serves:  # invalid: no version to name
            by_torch.setdefault(str(e.needs.torch).split("+")[0], []).append(e.name)
    if not by_torch:
        return None
    def one(version: str, names: List[str]) -> str:
        alone = len(names) == 1
        return "%s %s torch %s where %s (`pip install torch==%s` before laya-aot)%s" % (
            ", ".join(names), "needs" if alone else "need", version, "it serves" if alone else "they serve", version,
            "" if torch_tag(version) == torch_tag(here) else ", not this one")

    return "torch: %s; this process has torch %s" % (
        "; ".join(one(version, names) for version, names in sorted(by_torch.items())), here)


_PROBE_WORDS = {"cached": "none (probed here before)",
                "shipped": "none when the start pins the bundle (the build's verdict fits this machine), else one on "
                           "the first start",
                "child": "runs on the first start (no verdict for this machine yet)"}
# below this many columns the table's thirteen columns fold every cell: a list reads better
TABLE_WIDTH = 170


class WouldServe(NamedTuple):
    artifact: Optional[str]  # None: laya's eager forward
    text: str  # which, and why (rich markup)


def _would_serve(artifacts: List[Artifact], rows: List[Dict[str, Any]], here: Any, bundle_sha: str) -> WouldServe:
    """The artifact `laya_aot.load` tries first here, in the loader's own start order (`select.select`), and why
    (from the manifest and the hashes; the probe, the load and the smoke check come at load time)."""
    from .runtime.select import select

    usable = {r["name"] for r in rows if r["here"] == "usable"}
    order = select(artifacts, here, fits=lambda a: a.name in usable, bundle_sha256=bundle_sha)
    ranked, device = order.plan.order, here.device_type
    if not ranked:
        return WouldServe(None, "[bold]laya's eager forward[/] (no artifact of this bundle is usable here; each "
                                "artifact's \"on this machine\" says why)")
    first = ranked[0]
    lat = order.latencies(first)
    where = "at build" if order.ranking == "build" else order.ranking
    tie = order.why_first(first, [a for a in artifacts if a.name in usable])
    if lat and tie:
        why = "measured on %s %s: %s; %s" % (device, where, _latencies(lat), tie)
    elif lat:
        why = "the fastest usable artifact measured on %s %s: %s" % (device, where, _latencies(lat))
    else:
        why = "no latency measured on %s, so the kinds' fixed order decides" % device
    more = " (then %s if it fails to load)" % ", ".join(e.name for e in ranked[1:]) if len(ranked) > 1 else ""
    then = ""
    if order.plan.handover_to is not None:
        best = order.plan.handover_to
        then = ("; once it answers, [bold]%s[/] takes over in the background (the best measured mix: %s)"
                % (best.name, _latencies(order.latencies(best)) or "no figures"))
    return WouldServe(first.name, "[bold]%s[/] (given the checkpoint it was built from; %s)%s%s"
                      % (first.name, why, then, more))


def _latencies(per_shape: Dict[str, float]) -> str:
    return ", ".join("%.2f ms @%s" % (ms, shape) for shape, ms in per_shape.items())


def _build_latency(e: Artifact) -> str:
    """The build's figures, each with its spread (90th minus 10th percentile) where the build recorded one."""
    def one(dev: str, per_shape: Dict[str, float]) -> str:
        spread = e.latency_spread_ms.get(dev) or {}
        return ", ".join("%.2f ms @%s%s" % (ms, shape, " (spread %.2f)" % spread[shape] if shape in spread else "")
                         for shape, ms in per_shape.items())

    return "; ".join("%s %s" % (dev, one(dev, v)) for dev, v in e.latency_ms.items() if v) or "-"


def _cells(r: Dict[str, Any]) -> Dict[str, str]:
    """One artifact's figures as text, for the table and the list alike."""
    eager = r["eager_in_dtype"]
    return {
        "size": "%.1f MB" % (r["size"] / 1e6) if r["size"] else "-",
        "diff": ("%.2g / %.2g" % (r["max_abs_option_prob"], r["max_abs_action_prob"])
                 if r["max_abs_option_prob"] is not None else "-"),
        "eager": ("%.2g / %.2g, argmax %.1f%%" % (eager["max_abs_option_prob"], eager["max_abs_action_prob"],
                                                  100 * eager["argmax_agreement"]) if eager else "-"),
        "allowed": "%.3g" % r["tolerance"] if r["tolerance"] is not None else "-",
        "argmax": "%.1f%%" % (100 * r["argmax_agreement"]) if r["argmax_agreement"] is not None else "-",
        "margin": "%.2g" % r["tie_margin"] if r["tie_margin"] is not None else "-",
        "decisions": _decisions_cell(r["decisions"]),
        "dtype": _dtype_cell(r),
        "here": "[green]usable[/]" if r["here"] == "usable" else "[red]%s[/]" % escape(r["here"]),
    }


def _decisions_cell(d: Optional[Dict[str, Any]]) -> str:
    if not d:
        return "-"
    text = _decision_part(d)
    if d.get("near_ties"):
        text += "; near ties " + _decision_part(d["near_ties"])
    return text


def _decision_part(d: Dict[str, Any]) -> str:
    """One part of a decision statement: the artifact's agreement with fp32, laya eager's it is paired with (in its
    products' dtype where that is not the agents'), and laya eager's as it serves beside."""
    eager = "laya eager %s%.1f%%" % ("%s " % d["compared_with"] if d.get("compared_with") else "",
                                     100 * d["eager_in_dtype"])
    if d.get("laya_serving") is not None:
        eager += ", as served %.1f%%" % (100 * d["laya_serving"])
    return "%.1f%% of %d (%s, p %.2g)" % (100 * d["artifact"], d["decisions"], eager, d["p_value"])


def _dtype_cell(r: Dict[str, Any]) -> str:
    """The agents' dtype, and how the artifact computes where the manifest says (`manifest.Precision`)."""
    p = r["precision"]
    if not p or p["gemm"] == "fp32":
        return str(r["dtype"])
    return "%s (%s, %s products)" % (r["dtype"], p["policy"], p["gemm"])


def _artifact_table(title: str, rows: List[Dict[str, Any]], artifacts: List[Artifact]) -> Table:
    """On a terminal: a table as wide as the terminal (rich folds the cells that do not fit)."""
    t = Table(title=title)
    for col in ("artifact", "variant", "dtype", "size", "status", "max |dp| opt/act", "laya eager in dtype",
                "allowed", "argmax", "decisions vs fp32", "near-tie margin", "build latency", "on this machine"):
        t.add_column(col, overflow="fold")
    for r, e in zip(rows, artifacts):
        c = _cells(r)
        t.add_row(r["name"], str(r["variant"]), c["dtype"], c["size"], str(r["status"]), c["diff"], c["eager"],
                  c["allowed"], c["argmax"], c["decisions"], c["margin"], _build_latency(e), c["here"])
    return t


def _artifact_list(title: str, rows: List[Dict[str, Any]], artifacts: List[Artifact]) -> str:
    """Piped or on a narrow terminal: one block per artifact, one fact a line."""
    lines = [title]
    for r, e in zip(rows, artifacts):
        c = _cells(r)
        lines += ["", "%s: %s, %s, %s, %s" % (r["name"], r["status"], c["dtype"], c["size"], r["variant"]),
                  "  max |dp| option / action: %s (allowed %s), argmax agreement %s; laya eager in dtype: %s"
                  % (c["diff"], c["allowed"], c["argmax"], c["eager"]),
                  "  decisions vs fp32: %s" % c["decisions"],
                  "  computes: %s" % ((r["precision"] or {}).get("reason") or "as laya serves in %s" % r["dtype"]),
                  "  near-tie margin: %s; build latency: %s" % (c["margin"], _build_latency(e)),
                  "  on this machine: %s" % c["here"]]
    return "\n".join(lines)


def bench(argv: List[str], start: float) -> int:
    p = _bundle_parser("bench", "Time the artifacts of a bundle that this machine can run, on the build's mix of "
                       "shapes, and store the ranking for laya_aot.load here.")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="the checkpoint it was built from (default: the path its manifest records)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="timed rounds, each calling every artifact once per shape (default: %d)" % _bench_rounds())
    a = p.parse_args(argv)
    if a.rounds is not None and a.rounds < 1:
        p.error("--rounds %d: give a whole number >= 1" % a.rounds)
    return _guarded("bench", lambda: _bench(a))


def _bench_rounds() -> int:
    from .runtime.bench import ROUNDS

    return ROUNDS


def _bench(a: argparse.Namespace) -> int:
    """`laya-aot bench`: the ranking measured here (runtime/bench.py), printed and stored in the cache."""
    from .runtime import bench as bench_mod
    from .runtime.loader import LoadConfig, LoadSession
    from .runtime.measure import measure

    ckpt = a.checkpoint
    if ckpt is None:
        from . import kinds

        ckpt = read_bundle(a.bundle, kinds.BY_NAME).checkpoint.path
    session = LoadSession.open(ckpt, a.bundle, LoadConfig(device=a.device, handover=False))
    if not session.usable:
        raise BundleError(session.reasons())
    try:
        measured = measure(session, **({"rounds": a.rounds} if a.rounds else {}))
    except ValueError as e:
        raise BundleError(str(e)) from None
    here = session.order().here
    path = bench_mod.store(session.bundle.sha256, session.manifest.artifacts, here, measured)
    con = _console()
    ranked = sorted(measured.figures, key=lambda n: sum(measured.figures[n].values()))
    for name in ranked:
        con.print("%-24s %s (spread %s)" % (name, _latencies(measured.figures[name]),
                                            _latencies(measured.spread.get(name) or {})), soft_wrap=True)
    for name, why in measured.not_timed.items():
        con.print("%-24s not timed: %s" % (name, why), soft_wrap=True)
    con.print("ranking on %s, %s; stored in %s: `laya_aot.load` of this bundle on this machine ranks by it"
              % (here.device_type, measured.describe(), path), soft_wrap=True)
    return 0


def verify(argv: List[str], start: float) -> int:
    p = _bundle_parser("verify", "Re-check a bundle's hashes and re-run the numerical verification on this machine.",
                       device=False)
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="the Laya checkpoint directory the bundle was built from (its fingerprint is checked)")
    p.add_argument("--seed", type=int, default=None,
                   help="the seed of the verification cases (default: a new seed each run, fresh inputs)")
    a = p.parse_args(argv)
    return _guarded("verify", lambda: _verify(a))


def _verify(a: argparse.Namespace) -> int:
    import laya

    from . import checkpoint as ckpt_mod
    from . import kinds, verification
    from . import laya_internals as laya_api

    con = _console()
    try:
        m = read_bundle(a.bundle, kinds.BY_NAME)
    except BundleError as e:
        print("laya-aot verify: %s" % e, file=sys.stderr)
        return 2
    try:
        ckpt_mod.check_layout(Path(a.checkpoint), "--checkpoint (the Laya checkpoint directory the bundle was built "
                                                  "from)")
    except ckpt_mod.CheckpointError as e:
        print("laya-aot verify: %s" % e, file=sys.stderr)
        return 2
    why = ckpt_mod.mismatch(m, a.checkpoint)
    if why:
        print("laya-aot verify: %s: %s, or those files were changed or damaged since; pass the checkpoint it was "
              "built from, or rebuild the bundle" % (a.bundle, why), file=sys.stderr)
        return 2
    with warnings.catch_warnings(), progress.task("loading %s with laya" % a.checkpoint):
        warnings.simplefilter("ignore")
        agent = laya.load(a.checkpoint, device="cpu")
    model = agent.model.float().eval()
    seed = a.seed if a.seed is not None else int(time.time())
    vocab, pad_id, context = laya_api.vocab(agent), laya_api.pad_id(agent), laya_api.context_len(agent)
    checked: Dict[Any, Any] = {}  # per export range: the cases, their fp32 outputs, laya eager's figures

    def reference(r: Any) -> Any:
        if r not in checked:
            checked[r] = verification.reference(model, r, vocab, pad_id, seed, m.tolerance, context)
        return checked[r]

    tensors = kinds.model_tensors(model)
    failed = 0
    machines: Dict[str, Any] = {}
    t = Table(title="laya-aot verify %s (seed %d)" % (a.bundle, seed))
    for col in ("artifact", "hash", "result"):
        t.add_column(col, overflow="fold")
    with progress.task("verify", total=len(m.artifacts)) as line:
        for e in m.artifacts:
            line.describe("verify: %s" % e.name)
            failed += _verify_one(a, e, t, machines, model, tensors, reference)
            line.advance()
    con.print(t)
    return 1 if failed else 0


def _verify_one(a: argparse.Namespace, e: Artifact, t: Table, machines: Dict[str, Any], model: Any, tensors: Any,
                reference: Callable[[Any], Any]) -> int:
    """Re-check one artifact into the table `t` (`reference(ranges)`: what it is verified against); 1 when it
    fails."""
    import torch

    from . import kinds, verification
    from .bundle_format import artifact_path
    from .kinds.usable import machine_misfit
    from .variant import current_machine

    if e.invalid:  # values no build writes: the entry is not trusted enough to run
        t.add_row(e.name, "-", "[red]INVALID[/] its manifest entry: %s" % e.invalid)
        return 1
    kind = kinds.get(e.kind)
    if not e.built:
        t.add_row(e.name, "-", "not built: %s" % e.error)
        return 0
    why = check_artifact_hash(a.bundle, e)
    if why:
        t.add_row(e.name, "[red]MISMATCH[/]", why)
        return 1
    if e.device == "cuda" and not torch.cuda.is_available():
        t.add_row(e.name, "ok", "not run: needs a CUDA GPU")
        return 0
    if not kind.reverify:
        t.add_row(e.name, "ok", "not run: no numerical check for %s here" % e.kind)
        return 0
    if e.status == "failed_verification":  # the manifest already says it serves nothing
        t.add_row(e.name, "ok", "not run: failed verification at build (%s)" % (e.error or "see inspect"))
        return 0
    if e.device not in machines:
        machines[e.device] = current_machine(e.device)
    misfit = machine_misfit(e, machines[e.device])
    if misfit:  # a merged bundle holds artifacts for other machines (another torch, GPU or CPU)
        t.add_row(e.name, "ok", "not run here: %s" % misfit)
        return 0
    try:
        runner = kind.load(artifact_path(a.bundle, e), e, kinds.LoadEnv(device=e.device, tensors=tensors,
                                                                          model=model))
        res = verification.verify_artifact(runner, e.dtype, reference(e.ranges), e.device, label=e.name,
                                           gemm=e.precision.gemm if e.precision else None)
    except Exception as exc:  # noqa: BLE001 - reported in the table as this artifact's failure
        t.add_row(e.name, "ok", "[red]FAILED[/] %s: %s" % (type(exc).__name__, exc))
        return 1
    t.add_row(e.name, "ok", "[green]passed[/] max |dp| %.2g / %.2g, argmax %.1f%%" % (
        res.max_abs_option_prob, res.max_abs_action_prob, 100 * res.argmax_agreement)
        if res.passed else "[red]FAILED[/] %s" % res.reason)
    return 0 if res.passed else 1
