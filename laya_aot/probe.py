"""Load-and-run a native artifact once in a short-lived child process before trusting it in-process.

A native artifact can kill the process that loads it (an AOTInductor package built with the wrong
compiler segfaults inside the loader), and a segfault cannot be caught. So the first time an artifact
meets a machine, a child process loads it, runs one small batch and reports; the verdict is cached on
disk keyed by the artifact's sha256 and the machine's facts, so later starts pay nothing. The boundary is the
machine's: native code of a bundle runs in the service process only after this machine's own child passed it,
or when the caller pinned the bundle (`bundle_sha256`). The build probes every native artifact the same way and
ships its passing verdict's key in the manifest; a first start of a pinned bundle on a machine whose facts give
the same key (the build's GPU, torch, Python, CPU ISA) takes it instead of a child. An unpinned manifest's verdict
is never taken: its key's inputs are public, so any manifest can carry one that matches.

Run as a module it is the child: `python -m laya_aot.probe BUNDLE CHECKPOINT DEVICE`, with the artifact's
manifest entry (exactly the one the parent checked) in the file $LAYA_AOT_PROBE_ENTRY_FILE names, its sha256 in
$LAYA_AOT_PROBE_ENTRY_SHA256: a file, because Linux caps one environment variable at 128 KiB and a TileLang
artifact's entry (a record per kernel) is larger. Build and runtime both use it.

Most of a child's time is importing torch. On a machine whose cache holds no verdict yet (a first start, as
every start of a fresh container is), `start_ahead` starts a child as soon as `laya_aot.load` is called
and its checkpoint and bundle passed the checks that need no heavy import (looking `load` up starts nothing):
it imports torch and the kinds while the service imports its own, then waits (`--wait`) for the artifact that
`begin` hands it on stdin, with the environment a child started then would get. It is used only by a `begin`
with the same interpreter and the same variables its imports may read (`_IMPORT_ENV`), and ended when the load
that could have used it is over ($LAYA_AOT_PROBE_AHEAD=0 turns this off).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from .errors import LayaAotError
from .files import cache_dir, read_cache_json, write_cache_json
from .manifest import Artifact
from .variant import Machine

log = logging.getLogger(__name__)

TIMEOUT_S = 600.0  # a probe child's time limit unless LAYA_AOT_PROBE_TIMEOUT says otherwise (`timeout_s`)
_MARK = "LAYA_AOT_PROBE_RESULT "
# bumped when the child checks something new, so verdicts cached by an older probe are not trusted
PROBE_VERSION = 3
# a child ended by one of these was killed from outside (the out-of-memory killer, an operator, a shutdown):
# that says nothing about the artifact, so it is retried once and never cached
OUTSIDE_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# the entry's fields a child loads the artifact with; the build's outcome (status, verify, latency, files' list,
# the probe verdict itself) is written after its probe, so it is left out: the build's verdict keys later starts
KEYED_FIELDS = ("name", "kind", "device", "path", "variant", "dtype", "action_head_dtype", "ranges", "sha256",
                "details", "needs")


def verdict_key(art: Artifact, machine: Machine, device: str) -> str:
    """The verdict on `art` on this machine: a sha256 of its loaded fields (`KEYED_FIELDS`: its files' sha256 and
    everything the child loads it with), the machine's facts, the device and the probe's version, so an entry
    that differs in any of them (a damaged duplicate, another build, another GPU or torch) never shares a
    verdict with this one. The traced packages are left out of the machine's facts: a build records them and a
    start does not read them (an artifact bound to them is refused before any probe)."""
    entry = {k: v for k, v in art.to_dict().items() if k in KEYED_FIELDS}
    machine_facts = dict(machine.as_dict(), traced_packages=None)
    facts = json.dumps({"entry": hashlib.sha256(json.dumps(entry, sort_keys=True, default=str).encode()).hexdigest(),
                        "sha256": art.sha256, "machine": machine_facts, "device": device, "probe": PROBE_VERSION},
                       sort_keys=True)
    return hashlib.sha256(facts.encode()).hexdigest()


def verdict_path(art: Artifact, machine: Machine, device: str, key: Optional[str] = None) -> Path:
    """Where the verdict on `art` on this machine is cached (`verdict_key`, or `key` where already made)."""
    return cache_dir() / "probes" / ((key or verdict_key(art, machine, device)) + ".json")


class SettingError(LayaAotError, ValueError):
    """A setting (an environment variable) holds a value that cannot mean anything; the message names it."""


def timeout_s(env: Optional[Mapping[str, str]] = None) -> float:
    """LAYA_AOT_PROBE_TIMEOUT (seconds, default TIMEOUT_S), read when a probe starts (and by `laya-aot serve` as it
    starts); a value that is not a positive number of seconds is a SettingError naming it."""
    raw = (os.environ if env is None else env).get("LAYA_AOT_PROBE_TIMEOUT")
    if raw is None or not raw.strip():
        return TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1e7:
        raise SettingError("LAYA_AOT_PROBE_TIMEOUT=%r is not a number of seconds; set it to a positive number "
                           "(default %g) or unset it" % (raw[:40], TIMEOUT_S))
    return value


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return "loading it crashed a probe process: %s" % signal.Signals(-rc).name
        except ValueError:
            return "loading it crashed a probe process: signal %d" % -rc
    return "a probe process that loaded it exited with status %d" % rc


class Pending:
    """A probe child started early (for example while laya loads the checkpoint); `finish` collects it."""

    def __init__(self, entry: Artifact, path: Path, machine: Machine, device: str,
                 proc: Optional[subprocess.Popen] = None, cached: Optional[Dict[str, Any]] = None,
                 launch: Optional[Dict[str, Any]] = None, entry_file: Optional[str] = None):
        self.entry, self.path, self.machine, self.device = entry, path, machine, device
        self.proc, self.cached, self.launch = proc, cached, launch
        self.entry_file = entry_file  # the child's copy of the entry: removed once no child can read it
        self.t0 = time.perf_counter()
        self.cancelled = False

    def drop_entry_file(self) -> None:
        if self.entry_file is not None:
            try:
                os.unlink(self.entry_file)
            except OSError:
                pass
            self.entry_file = None

    def relaunch(self) -> None:
        """Start the child again (after it was killed from outside)."""
        assert self.launch is not None
        self.proc = subprocess.Popen(**self.launch)

    @classmethod
    def failed(cls, entry: Artifact, path: Path, machine: Machine, device: str, why: str) -> "Pending":
        """A probe that could not start: the artifact is rejected with `why`, and nothing is cached (the
        cause is this machine's setup, not the artifact)."""
        return cls(entry, path, machine, device, cached={"reason": why, "graphs": why, "not_cached": True})

    def cancel(self) -> None:
        """Kill the child: its verdict, whatever `finish` then sees, is not cached."""
        self.cancelled = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.drop_entry_file()


ENV_AHEAD = "LAYA_AOT_PROBE_AHEAD"
# "0": the build's shipped verdicts are not taken even for a pinned bundle; every machine's first start runs the
# child (a fleet whose drivers or system libraries differ from the build machine's, which its facts leave out)
ENV_SHIPPED = "LAYA_AOT_PROBE_SHIPPED"

WAIT_S = 300.0  # how long a child started ahead waits for its artifact before it exits on its own
_ahead: Optional[Tuple[subprocess.Popen, Any]] = None
_ahead_tried = False
_ahead_lock = threading.Lock()


def _off(name: str) -> bool:
    """Whether the switch in environment variable `name` (on by default) is turned off."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")


def _child_env() -> Dict[str, str]:
    return dict(os.environ, PYTHONFAULTHANDLER="0")


# variables a child's imports may read (the interpreter's, the linker's, torch's and its libraries'): a child
# started ahead is used only if these are as they are now; the rest of the environment it takes with its artifact
_IMPORT_ENV = ("PYTHON", "LD_", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "TRITON", "TILELANG", "TVM")


def _spawn_key(env: Dict[str, str]) -> Any:
    """What a child started ahead must share with one started now: the interpreter and `_IMPORT_ENV`."""
    return sys.executable, tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_ENV)))


def start_ahead() -> bool:
    """Start a probe child that imports what every child imports and then waits for its artifact (module doc),
    once per process, only where no verdict is cached at all; whether one started."""
    global _ahead, _ahead_tried
    with _ahead_lock:
        if _ahead_tried:
            return False
        _ahead_tried = True
        if _off(ENV_AHEAD):
            return False
        try:
            probes = cache_dir() / "probes"
            if probes.is_dir() and any(probes.glob("*.json")):
                return False
            timeout_s()
            env = _child_env()
            proc = subprocess.Popen([sys.executable, "-m", __name__, "--wait"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        except (OSError, SettingError) as e:  # a probe started when needed says what is wrong
            log.debug("no probe child started ahead: %s", e)
            return False
        _ahead = (proc, _spawn_key(env))
        return True


def _take_ahead(key: Any) -> Optional[subprocess.Popen]:
    """The child started ahead, if it is still waiting and was started exactly as `begin` would start one."""
    global _ahead
    with _ahead_lock:
        got, _ahead = _ahead, None
    if got is None:
        return None
    proc, spawned = got
    if spawned == key and proc.poll() is None:
        return proc
    _end(proc)
    return None


def end_ahead() -> None:
    """End a child started ahead that no start took (the load it was for is over)."""
    global _ahead
    with _ahead_lock:
        got, _ahead = _ahead, None
    if got is not None:
        _end(got[0])


def _end(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
        proc.communicate(timeout=10)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass


def cached_verdict(entry: Artifact, machine: Machine, device: str, pinned: bool = False
                   ) -> Optional[Dict[str, Any]]:
    """The verdict an earlier start's child recorded for `entry` on this machine (`_collect` wrote it; one naming
    another artifact or sha256, copied from another key's, or not one at all: `files.read_cache_json`, is none),
    else, for a `pinned` bundle only, the build's passing one where the build's machine had this machine's facts
    (`shipped_verdict`); None: a probe child will run."""
    path = verdict_path(entry, machine, device)
    own = read_cache_json(path, {"reason": (str, type(None)), "graphs": (str, type(None)), "artifact": str,
                                 "sha256": str})
    if own is not None and (own["artifact"] != entry.name or own["sha256"] != entry.sha256):
        own = None
    if own is not None or not pinned:
        return own
    return shipped_verdict(entry, machine, device)


def shipped_verdict(entry: Artifact, machine: Machine, device: str) -> Optional[Dict[str, Any]]:
    """The build's passing verdict shipped in the entry (`Artifact.probe_verdict`, read from the bundle at every
    start, never copied into the cache) where its key is this machine's: a hint that only a pinned bundle may take
    (`cached_verdict`), since anyone can recompute a key from the entry and the machine's published facts."""
    shipped = entry.probe_verdict  # keyed by the build with the artifact's device type: cuda:1's is cuda's
    if shipped is None or _off(ENV_SHIPPED):
        return None
    device_type = str(device).split(":")[0]
    if shipped.key != verdict_key(entry, machine, device_type):
        return None
    return {"artifact": entry.name, "sha256": entry.sha256, "reason": None, "graphs": shipped.graphs, "shipped": True}


def begin(bundle: Path, entry: Artifact, checkpoint: Path, device: str, machine: Machine,
          pinned: bool = False) -> Pending:
    """Start the probe child for `entry` (or read its cached verdict: `cached_verdict`) without waiting for it."""
    path = verdict_path(entry, machine, device)
    cached = cached_verdict(entry, machine, device, pinned)
    if cached is not None:
        return Pending(entry, path, machine, device, cached=cached)
    try:
        timeout_s()
    except SettingError as e:
        return Pending.failed(entry, path, machine, device, "it could not be probed: %s" % e)
    cmd = [sys.executable, "-m", __name__, str(bundle), str(checkpoint), device]
    base = _child_env()
    try:
        entry_file, digest = _write_entry(entry)
    except OSError as e:
        return Pending.failed(entry, path, machine, device, "it could not be probed: its manifest entry could not be "
                              "written for the probe process (%s); the temporary directory must be writable" % e)
    env = dict(base, LAYA_AOT_PROBE_ENTRY_FILE=entry_file, LAYA_AOT_PROBE_ENTRY_SHA256=digest)
    launch = dict(args=cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ahead = _take_ahead(_spawn_key(base))
    if ahead is not None:  # past its imports already: it takes this artifact on stdin
        try:
            assert ahead.stdin is not None
            ahead.stdin.write(json.dumps({"bundle": str(bundle), "checkpoint": str(checkpoint), "device": device,
                                          "env": env}) + "\n")
            ahead.stdin.close()
            ahead.stdin = None  # closed: `communicate` must not flush or close it again
            return Pending(entry, path, machine, device, proc=ahead, launch=launch, entry_file=entry_file)
        except OSError:
            _end(ahead)
    try:
        proc = subprocess.Popen(**launch)
    except OSError as e:  # the interpreter cannot be run by this user, no process left, ...: this artifact's probe
        os.unlink(entry_file)
        return Pending.failed(entry, path, machine, device, "a probe process could not start (%s: %s %s); the "
                              "service's user must be able to run %s" % (type(e).__name__, e.strerror or e,
                                                                          sys.executable, sys.executable))
    return Pending(entry, path, machine, device, proc=proc, launch=launch, entry_file=entry_file)


def _write_entry(entry: Artifact) -> Tuple[str, str]:
    """The entry as a private temporary file for the child (module docstring), and its sha256."""
    import tempfile

    text = json.dumps(entry.to_dict())
    fd, name = tempfile.mkstemp(prefix="laya-aot-probe-entry-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return name, hashlib.sha256(text.encode()).hexdigest()


def _killed_from_outside(rc: Optional[int]) -> Optional[str]:
    if rc is not None and rc < 0 and -rc in [int(s) for s in OUTSIDE_SIGNALS]:
        return signal.Signals(-rc).name
    return None


def finish(pending: Pending, stats: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """Wait for a started probe; None when the artifact loaded and ran in the child, else the reason."""
    stats = stats if stats is not None else {}
    if pending.cached is not None:
        said = ("not started" if pending.cached.get("not_cached") else "shipped" if pending.cached.get("shipped")
                else "cached")
        stats.update(probe=said, probe_seconds=0.0,
                     probe_graphs=pending.cached.get("graphs", "not probed"))
        return pending.cached.get("reason")
    assert pending.proc is not None
    try:
        return _collect(pending, stats)
    finally:
        pending.drop_entry_file()


def _collect(pending: Pending, stats: Dict[str, Any]) -> Optional[str]:
    """`finish` for a started child: wait for it (once more if it was killed from outside), read its verdict."""
    assert pending.proc is not None
    limit = timeout_s()  # checked by `begin`
    for attempt in (1, 2):
        try:
            out, err = pending.proc.communicate(timeout=max(1.0, limit - (time.perf_counter() - pending.t0)))
        except subprocess.TimeoutExpired:
            pending.cancel()
            stats.update(probe="timeout", probe_seconds=time.perf_counter() - pending.t0)
            return "a probe process that loaded it did not finish within %.0f s" % limit
        if pending.cancelled:  # killed by the loader that started it: says nothing about the artifact
            stats.update(probe="cancelled", probe_seconds=time.perf_counter() - pending.t0)
            return "its probe was cancelled (the load that started it stopped)"
        killed = _killed_from_outside(pending.proc.returncode)
        if killed is None or pending.launch is None:
            break
        if attempt == 2:  # not the artifact's fault as far as anyone can tell: not cached, probed again next start
            stats.update(probe="killed", probe_seconds=time.perf_counter() - pending.t0)
            return ("a probe process that loaded it was killed from outside (%s) twice, as an out-of-memory "
                    "killer or a shutdown does; not cached: the next start probes it again" % killed)
        log.warning("laya-aot: the probe of %s was killed from outside (%s); probing it once more",
                    pending.entry.name, killed)
        stats["probe_retried_after"] = killed
        try:
            pending.relaunch()
        except OSError as e:
            return "a probe process could not start again (%s)" % (e.strerror or e)
    seconds = time.perf_counter() - pending.t0
    rc = pending.proc.returncode
    reason: Optional[str] = None
    line = next((x[len(_MARK):] for x in out.splitlines() if x.startswith(_MARK)), None)
    try:
        result = json.loads(line) if line else {}
    except ValueError:
        result = {}
    result = result if isinstance(result, dict) else {}
    if rc != 0:
        tail = (err.strip().splitlines() or [""])[-1][:300]
        reason = _describe_exit(rc) + (" (%s)" % tail if tail and rc > 0 else "")
    elif not result.get("ok"):
        reason = "a probe process could not run it: %s" % (result.get("error") if line else "no result")
    # None: CUDA graphs captured and replayed in the child; else why not (or "not probed")
    graphs = result.get("graphs", "not probed") if reason is None else reason
    stats.update(probe="ran", probe_seconds=seconds, probe_graphs=graphs)
    if isinstance(result.get("timeline"), dict):  # where the child's time went (interpreter start excluded)
        stats["probe_timeline"] = result["timeline"]
    entry = pending.entry
    # a cache that cannot be written must not stop a load; the probe just runs again next time
    write_cache_json(pending.path, {"artifact": entry.name, "sha256": entry.sha256, "reason": reason,
                                    "graphs": graphs, "seconds": round(seconds, 3),
                                    "machine": pending.machine.as_dict(), "device": pending.device,
                                    "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                     "every start runs %s in a probe child again" % entry.name)
    return reason


def probe(bundle: Path, entry: Artifact, checkpoint: Path, device: str, machine: Machine,
          stats: Optional[Dict[str, Any]] = None, pinned: bool = False) -> Optional[str]:
    """None when the artifact loads and runs in a child process on this machine, else the reason."""
    return finish(begin(bundle, entry, checkpoint, device, machine, pinned), stats)


def _wait_for_artifact() -> int:
    """`--wait`: import what a child needs now, then probe the artifact `begin` writes on stdin (nothing within
    WAIT_S, or stdin closed: exit without a word)."""
    import select

    t0 = time.perf_counter()
    import torch  # noqa: F401 - the point: imported while the service imports its own

    from . import kinds

    kinds.BY_NAME  # noqa: B018 - the registry, with every kind's module
    imported = time.perf_counter() - t0
    ready, _, _ = select.select([sys.stdin], [], [], WAIT_S)
    line = sys.stdin.readline() if ready else ""
    if not line.strip():
        return 0
    job = json.loads(line)
    os.environ.clear()  # the environment a child started now would get, its artifact's entry included
    os.environ.update(job["env"])
    return _child(job["bundle"], job["checkpoint"], job["device"], ahead={"imported_ahead_s": round(imported, 3)})


def _child(bundle: str, checkpoint: str, device: str, ahead: Optional[Dict[str, Any]] = None) -> int:
    """Load the artifact, run one small batch (and, where its kind replays CUDA graphs, capture and replay
    it), report on stdout.

    The kind decides what the child loads it with (`Kind.probe_env`): an AOTInductor package runs on
    stand-in weights of the checkpoint's shapes, since a crash does not depend on the values and reading
    the real ones would double the first start's disk and GPU traffic while laya loads them in the
    parent. Outputs on stand-in weights are not judged here; the parent's smoke check compares the
    real-weight outputs with the build's reference.
    """
    t0 = time.perf_counter()
    import torch

    from . import kinds
    from .bundle_format import artifact_path
    from .padding import smallest_batch

    timeline = {"imports_s": time.perf_counter() - t0}
    entry = _entry_from_env()
    kind = kinds.get(entry.kind)
    path = artifact_path(bundle, entry)
    env = kind.probe_env(path, entry, Path(checkpoint), device)
    timeline["stand_in_weights_s"] = time.perf_counter() - t0 - sum(timeline.values())
    runner = kind.load(path, entry, env)
    timeline["load_s"] = time.perf_counter() - t0 - sum(timeline.values())
    inputs = [x.to(runner.device) for x in smallest_batch(entry.ranges)]
    logits, act = runner(*inputs)
    result: Dict[str, Any] = {"ok": True, "error": None}
    if env.tensors is None:  # real weights: the outputs must at least be finite
        ok = bool(torch.isfinite(logits[:, :2]).all() and torch.isfinite(act).all())
        result = {"ok": ok, "error": None if ok else "non-finite outputs"}
    timeline["first_call_s"] = time.perf_counter() - t0 - sum(timeline.values())
    graphs = getattr(runner, "graphs", None)
    if graphs is not None:
        runner(*inputs)  # the second call of a shape captures it, then checks one replay
        gstats = graphs.stats
        result["graphs"] = (None if gstats.get("graphs") else "; ".join((gstats.get("refused") or {}).values())
                            or "no graph was captured")
        timeline["graph_capture_s"] = time.perf_counter() - t0 - sum(timeline.values())
    result["timeline"] = dict({k: round(v, 3) for k, v in timeline.items()}, **(ahead or {}))
    print(_MARK + json.dumps(result), flush=True)
    return 0


def _entry_from_env() -> Artifact:
    from . import kinds
    from .manifest import BundleError, read_artifact

    text = Path(os.environ["LAYA_AOT_PROBE_ENTRY_FILE"]).read_text(encoding="utf-8")
    if hashlib.sha256(text.encode()).hexdigest() != os.environ.get("LAYA_AOT_PROBE_ENTRY_SHA256"):
        raise BundleError("the probe's entry file changed after the loader wrote it")
    return read_artifact(json.loads(text), kinds.BY_NAME, "the probe's entry")


if __name__ == "__main__":
    sys.exit(_wait_for_artifact() if sys.argv[1:] == ["--wait"] else _child(*sys.argv[1:4]))
