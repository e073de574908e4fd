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
from typing import Any, Callable, Dict, List

from rich.console import Console
from rich.table import Table

from .manifest import MANIFEST, Artifact, BundleError, bundle_sha256, check_artifact_hash, read_bundle

log = logging.getLogger(__name__)

DEMO_BUNDLE = "artifacts/demo"

DEMO_QUESTIONS: Dict[str, Dict[str, Any]] = {
    "team": {"type": "choice", "instructions": "Which team should handle this message?",
             "criteria": {"billing": "payments, invoices, refunds", "technical": "errors, outages, bugs",
                          "account": "login, password, profile"}},
    "urgency": {"type": "score", "instructions": "How urgent is this message?",
                "criteria": ["not urgent", "somewhat urgent", "urgent", "critical, act now"]},
    "angry": {"type": "noul", "instructions": "The customer is angry."},
}
DEMO_STATES = [
    "I was charged twice for the March invoice, please refund the second payment.",
    "The service has been down since this morning and nobody in the office can log in!",
    "Please reset my password, I forgot it after the holidays.",
]


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 140)


def _demo_checkpoint() -> Path:
    from . import checkpoint as ckpt_mod
    from .config import CheckpointConfig

    return ckpt_mod.resolve(CheckpointConfig(name="demo", demo_shape="tiny"))


def demo(argv: List[str], start: float) -> int:
    p = argparse.ArgumentParser(prog="laya-aot demo", description="Build the demo bundle if missing, load it, "
                                "answer a few typed questions.")
    p.add_argument("--bundle", default=DEMO_BUNDLE)
    p.add_argument("--checkpoint", default=None, help="default: the built-in demo checkpoint")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    con = _console()
    ckpt = Path(a.checkpoint) if a.checkpoint else _demo_checkpoint()
    built_s = 0.0
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
        built_s = time.perf_counter() - t0
    import laya_aot

    t_load = time.perf_counter()
    agent = laya_aot.load(str(ckpt), bundle=a.bundle, device=a.device)
    loaded = time.perf_counter()
    results = agent.predict_batch(DEMO_STATES, DEMO_QUESTIONS)
    first = time.perf_counter()
    t = Table(title="decisions (backend %s)" % agent.backend)
    for col in ("state", "team", "urgency (score)", "angry (noul)"):
        t.add_column(col)
    for state, r in zip(DEMO_STATES, results):
        ans = r["answers"]
        t.add_row(state[:48] + ("..." if len(state) > 48 else ""),
                  "%s (%.2f)" % (ans["team"]["choice"], ans["team"]["answer_confidence"]),
                  "%.2f" % ans["urgency"]["score"], "%.2f" % ans["angry"]["noul"])
    con.print(t)
    bo = agent.backend_object
    art = getattr(bo, "artifact", None)
    con.print("backend: [bold]%s[/]  artifact: %s  variant: %s" % (agent.backend, art.name if art else None,
                                                                   getattr(bo, "variant", None)))
    for name, why in getattr(bo, "rejected", []):
        con.print("  not used: %s: %s" % (name, why))
    con.print("process start -> first answer: [bold]%.2f s[/] (bundle load %.2f s, first predict %.3f s%s)"
              % (first - start - built_s, loaded - t_load, first - loaded,
                 "; the bundle build before it took %.1f s" % built_s if built_s else ""))
    return 0


def _usable_here(bundle: Path, art: Artifact, device: str, machine, serving: str) -> str:
    from .runtime.select import reject_reason

    why = reject_reason(art, machine, device, serving) or (check_artifact_hash(bundle, art) if art.built else None)
    return "usable" if why is None else why


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
    p = argparse.ArgumentParser(prog="laya-aot inspect", description="List a bundle's artifacts and whether each "
                                "is usable on this machine.")
    p.add_argument("bundle")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default=None, type=device_arg,
                   help="the agent's device: cpu, cuda or cuda:N (default: cuda when visible, else cpu)")
    a = p.parse_args(argv)
    return _guarded("inspect", lambda: _inspect(a))


def device_arg(value: str) -> str:
    """--device as argparse checks it: a message naming the option, not an internal error."""
    from .variant import check_device

    try:
        return check_device(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _inspect(a: argparse.Namespace) -> int:
    import torch

    from . import kinds
    from .precision import expected_serving_dtype
    from .variant import current_machine

    try:
        raw_sha = bundle_sha256(a.bundle)
        m = read_bundle(a.bundle, kinds.NAMES, sha256=raw_sha)
    except BundleError as e:
        print("laya-aot inspect: %s" % e, file=sys.stderr)
        return 2
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    machine = current_machine(device)
    dev_type = torch.device(device).type
    serving = expected_serving_dtype({"amp_dtype": m.checkpoint.amp_dtype}, dev_type, machine.gpu_arch)
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
                     "here": _usable_here(Path(a.bundle), e, dev_type, machine, serving)})
    if a.json:
        print(json.dumps({"bundle": a.bundle, "bundle_sha256": raw_sha, "checkpoint": m.checkpoint.name,
                          "machine": machine.as_dict(),
                          "device": device, "serving_dtype": serving, "artifacts": rows}, indent=2))
        return 0
    t = Table(title="%s (checkpoint %s, built %s; laya serves it in %s on %s here)"
              % (a.bundle, m.checkpoint.name, m.created, serving, dev_type))
    for col in ("artifact", "variant", "dtype", "size", "status", "max |dp| opt/act", "laya eager in dtype",
                "allowed", "argmax", "near-tie margin", "on this machine"):
        t.add_column(col, overflow="fold")
    for r in rows:
        diff = ("%.2g / %.2g" % (r["max_abs_option_prob"], r["max_abs_action_prob"])
                if r["max_abs_option_prob"] is not None else "-")
        eager = r["eager_in_dtype"]
        t.add_row(r["name"], str(r["variant"]), str(r["dtype"]), "%.1f MB" % (r["size"] / 1e6) if r["size"] else "-",
                  str(r["status"]), diff,
                  "%.2g / %.2g, argmax %.1f%%" % (eager["max_abs_option_prob"], eager["max_abs_action_prob"],
                                                  100 * eager["argmax_agreement"]) if eager else "-",
                  "%.3g" % r["tolerance"] if r["tolerance"] is not None else "-",
                  "%.1f%%" % (100 * r["argmax_agreement"]) if r["argmax_agreement"] is not None else "-",
                  "%.2g" % r["tie_margin"] if r["tie_margin"] is not None else "-",
                  "[green]usable[/]" if r["here"] == "usable" else "[red]%s[/]" % r["here"])
    con = _console()
    con.print(t)
    con.print("near-tie margin: a row whose top two option probabilities are closer than this is answered by "
              "laya's eager forward: the whole call by default, near_ties=\"rows\" only those rows, "
              "near_ties=\"off\" neither", soft_wrap=True)
    con.print("bundle sha256 (pin it with laya_aot.load(..., bundle_sha256=...) or LAYA_AOT_BUNDLE_SHA256): %s"
              % raw_sha, soft_wrap=True)
    return 0


def verify(argv: List[str], start: float) -> int:
    p = argparse.ArgumentParser(prog="laya-aot verify", description="Re-check a bundle's hashes and re-run the "
                                "numerical verification on this machine.")
    p.add_argument("bundle")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--seed", type=int, default=None, help="default: a new seed each run (fresh inputs)")
    a = p.parse_args(argv)
    return _guarded("verify", lambda: _verify(a))


def _verify(a: argparse.Namespace) -> int:
    import laya
    import torch

    from . import checkpoint as ckpt_mod
    from . import kinds
    from . import laya_internals as laya_api
    from .manifest import artifact_path
    from .tolerance import rule_for
    from .variant import current_machine, mismatch
    from .verification import EagerFigures, cases, reference_outputs, verify_runner

    con = _console()
    try:
        m = read_bundle(a.bundle, kinds.NAMES)
    except BundleError as e:
        print("laya-aot verify: %s" % e, file=sys.stderr)
        return 2
    if not Path(a.checkpoint).is_dir():
        print("laya-aot verify: --checkpoint %s does not exist or is not a directory; pass the Laya checkpoint "
              "directory the bundle was built from" % a.checkpoint, file=sys.stderr)
        return 2
    try:
        ckpt_mod.check_layout(Path(a.checkpoint))
    except ckpt_mod.CheckpointError as e:
        print("laya-aot verify: --checkpoint: %s" % e, file=sys.stderr)
        return 2
    fp = ckpt_mod.fingerprint(a.checkpoint)
    here = fp["sha256"]
    built_from = m.checkpoint.fingerprint.sha256
    if here != built_from:
        recorded = m.checkpoint.fingerprint.files
        differ = sorted(k for k in set(recorded) | set(fp["files"]) if recorded.get(k) != fp["files"].get(k))
        print("laya-aot verify: %s does not match the checkpoint %s was built from (fingerprint %s..., the bundle's "
              "%s...; differing: %s): the bundle was built from another checkpoint, or these files were changed "
              "or damaged since; pass the checkpoint it was built from, or rebuild the bundle"
              % (a.checkpoint, a.bundle, here[:12], built_from[:12], ", ".join(differ[:5]) or "?"), file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya.load(a.checkpoint, device="cpu")
    reference = agent.model.float().eval()
    tensors = kinds.model_tensors(reference)
    pad_id = laya_api.pad_id(agent)
    vocab = laya_api.vocab(agent)
    seed = a.seed if a.seed is not None else int(time.time())
    checked: Dict[Any, Any] = {}  # per export range: the cases, their fp32 outputs, laya eager's figures
    failed = 0
    machines: Dict[str, Any] = {}
    t = Table(title="laya-aot verify %s (seed %d)" % (a.bundle, seed))
    for col in ("artifact", "hash", "result"):
        t.add_column(col, overflow="fold")
    for e in m.artifacts:
        kind = kinds.get(e.kind)
        if e.invalid:  # values no build writes: the entry is not trusted enough to run
            failed += 1
            t.add_row(e.name, "-", "[red]INVALID[/] its manifest entry: %s" % e.invalid)
            continue
        if not e.built:
            t.add_row(e.name, "-", "not built: %s" % e.error)
            continue
        why = check_artifact_hash(a.bundle, e)
        if why:
            failed += 1
            t.add_row(e.name, "[red]MISMATCH[/]", why)
            continue
        if e.device == "cuda" and not torch.cuda.is_available():
            t.add_row(e.name, "ok", "not run: needs a CUDA GPU")
            continue
        if not kind.reverify:
            t.add_row(e.name, "ok", "not run: no numerical check for %s here" % e.kind)
            continue
        if e.status == "failed_verification":  # the manifest already says it serves nothing
            t.add_row(e.name, "ok", "not run: failed verification at build (%s)" % (e.error or "see inspect"))
            continue
        if e.device not in machines:
            machines[e.device] = current_machine(e.device)
        misfit = mismatch(e.needs, machines[e.device])
        if misfit:  # a merged bundle holds artifacts for other machines (another torch, GPU or CPU)
            t.add_row(e.name, "ok", "not run here: %s" % misfit)
            continue
        r = e.ranges
        try:
            runner = kind.load(artifact_path(a.bundle, e), e, kinds.LoadEnv(device=e.device, tensors=tensors,
                                                                              model=reference))
            if r not in checked:
                case_list = cases(seed, r, vocab, pad_id, laya_api.context_len(agent))
                references = reference_outputs(reference, case_list)
                checked[r] = (case_list, references, EagerFigures(reference, case_list, references))
            case_list, references, figures = checked[r]
            eager = figures.get(e.dtype, e.device)  # laya's eager forward in the artifact's dtype and device
            res = verify_runner(runner, reference, case_list, r, pad_id, runner.device,
                                rule_for(e.dtype, m.tolerance, eager), references, eager)
        except Exception as exc:  # noqa: BLE001 - reported in the table as this artifact's failure
            failed += 1
            t.add_row(e.name, "ok", "[red]FAILED[/] %s: %s" % (type(exc).__name__, exc))
            continue
        failed += not res.passed
        t.add_row(e.name, "ok", "[green]passed[/] max |dp| %.2g / %.2g, argmax %.1f%%" % (
            res.max_abs_option_prob, res.max_abs_action_prob, 100 * res.argmax_agreement)
            if res.passed else "[red]FAILED[/] %s" % res.reason)
    con.print(t)
    return 1 if failed else 0
