"""`laya-aot serve`: laya's own HTTP server, with every load of a bundled checkpoint going through a bundle.

laya's server loads, evicts and unloads checkpoints, each load a cold start. This runs the same app
(`laya.serve.create_app`, every `LAYA_*` setting as laya reads it) over a Router whose builds of a
checkpoint in `LAYA_AOT_BUNDLES` (JSON: model name -> bundle directory, pack, directory of packs or hf:// spec) call
`laya_aot.load`; `LAYA_AOT_STRICT=1` makes a bundle that cannot serve fail its load, and
`LAYA_AOT_BUNDLE_SHA256S` pins each manifest. One log line per load and `GET /v1/aot` say which
artifact serves and why the others did not; every route laya defines answers as in laya's own app.
Concurrent requests are merged into shared calls by a dynamic batcher (laya_aot/serve_batching.py,
LAYA_AOT_BATCH*), and LAYA_AOT_METRICS=1 adds `GET /metrics` (Prometheus).
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import re
import sys
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from . import laya_internals as laya_api
from . import serve_workers
from .distribution import HF_SCHEME, PACK_SUFFIX
from .distribution.pack import MAX_RATIO
from .errors import LayaAotError
from .probe import TIMEOUT_S
from .runtime.batcher import Limits
from .serve_batching import (
    DEFAULT_ENGINE_LANES,
    ENV_BATCH,
    ENV_METRICS,
    LIMIT_SETTINGS,
    METRICS_ROUTE,
    ServeBatching,
    lanes_from_env,
    limits_from_env,
)

log = logging.getLogger("laya_aot.serve")

ENV_BUNDLES = "LAYA_AOT_BUNDLES"
ENV_STRICT = "LAYA_AOT_STRICT"
ENV_PINS = "LAYA_AOT_BUNDLE_SHA256S"
ENV_PIN = "LAYA_AOT_BUNDLE_SHA256"  # laya_aot.load's own pin, read from the environment by every load
ENV_NEAR_TIES = "LAYA_AOT_NEAR_TIES"
ENV_ENGINE = "LAYA_AOT_ENGINE"  # runtime/engine.ENV_ENGINE (not imported here: it is read before anything loads)
_EXAMPLE = """'{"support": "/bundles/support"}'"""
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

USAGE = """usage: laya-aot serve

laya's HTTP server (POST /v1/systemone, /v1/systemone/batch, GET /health), configured as `laya serve` is,
by environment (LAYA_PORT, LAYA_HOST, LAYA_API_KEY, LAYA_EXTRA_MODELS, LAYA_MODELS, LAYA_PRELOAD,
LAYA_MAX_LOADED, LAYA_IDLE_UNLOAD_SECONDS, LAYA_DEVICE, ...), plus:

  LAYA_AOT_BUNDLES         JSON object: model name -> bundle (a directory, a pack, a directory of packs or
                           hf://ORG/REPO), e.g. %s
  LAYA_AOT_STRICT          1: a bundle that cannot serve its checkpoint fails that load (at start: no start)
  LAYA_AOT_BUNDLE_SHA256S  JSON object: model name -> sha256 of the bundle's bundle.json (a pin)
  LAYA_AOT_NEAR_TIES       who decides near-ties: 0 / off (default: the artifact, whose agreement with fp32
                           was measured against laya's own), call (laya's eager forward recomputes a call
                           with a near-tie: laya's bitwise outputs, at an eager forward's cost), rows (it
                           recomputes those rows only)
  LAYA_AOT_BATCH           1 (default): concurrent requests that may share a call are merged into one
                           predict_batch call and split back (a request alone runs as laya runs it);
                           0: one request at a time, as laya serve
  LAYA_AOT_BATCH_MAX_ROWS  question rows (states x questions) in one merged call (default %d)
  LAYA_AOT_BATCH_MAX_TOKENS  estimated tokens in one merged call (default %d)
  LAYA_AOT_BATCH_MAX_WAIT_MS  longest a call's first request waits for neighbours (default %g: none)
  LAYA_AOT_BATCH_QUEUE     requests waiting for a call; one more gets laya's 503 at once (default %d)
  LAYA_AOT_BATCH_BUCKETS   1 (default): a merged call holds requests whose rows are estimated within 2x of each
                           other (short rows are not padded to long ones); 0: requests of any length share a call
  LAYA_AOT_METRICS         1: GET /metrics in Prometheus's text format, authorised as /v1/aot (default 0)
  LAYA_AOT_WORKERS         worker processes answering on LAYA_PORT (default 1), each a whole server with its
                           own copy of every resident model on the same device: more requests/s where one
                           process's host work is the limit (docs/batching.md)
  LAYA_AOT_ENGINE          1 (with LAYA_AOT_WORKERS > 1): one engine process loads the bundled checkpoints on
                           the device and runs every worker's artifact calls, merged; the workers keep HTTP,
                           tokenising and decoding, with no weights or device context of their own (default 0)
  LAYA_AOT_ENGINE_LANES    over an engine: the calls each worker's batcher sends to it at once, which it
                           merges with the other workers' (default %d)
  LAYA_AOT_GIL_SWITCH_MS   Python's thread switch interval in every process of the server, in milliseconds
                           (default: Python's 5): how long a thread woken by an answer may wait for the running
                           one (docs/batching.md)
  LAYA_AOT_BUNDLE_SHA256   one bundle's pin, as laya_aot.load(bundle_sha256=...) (one bundle only)
  LAYA_AOT_CACHE_DIR       per-machine state: probe verdicts, digests, tokenizer snapshots, unpacked packs
                           (default ~/.cache/laya-aot)
  LAYA_AOT_PROBE_SHIPPED   0: a pinned bundle's shipped probe verdicts are not taken (default 1)
  LAYA_AOT_PROBE_AHEAD     0: no probe child started ahead of a first start's load (default 1)
  LAYA_AOT_PROBE_TIMEOUT   seconds a probe child may take (default %g)
  LAYA_AOT_UNPACK_MAX_RATIO  bytes a pack may unpack to per byte of pack (default %d)

Checkpoints without a bundle load exactly as in `laya serve`. GET /v1/aot (authorised as laya's /health
detail is) says what serves each resident checkpoint and why each other artifact was not used, and what
the batcher did (histograms of requests per call and of the wait).""" % ((_EXAMPLE,) + tuple(
    default for _, default in LIMIT_SETTINGS.values()) + (DEFAULT_ENGINE_LANES, TIMEOUT_S, MAX_RATIO))


class ServeConfigError(LayaAotError, ValueError):
    """A `LAYA_AOT_*` setting that cannot be served; the message names the cause and the fix."""


@dataclass(frozen=True)
class BundleSpec:
    """One bundled checkpoint: the Router's name for it, its bundle and the checkpoint directory it was built from."""

    model: str
    bundle: str
    checkpoint: Path
    sha256: Optional[str] = None
    packed: bool = False  # a pack or a directory of packs, which laya_aot.load unpacks once into its cache

    @property
    def remote(self) -> bool:
        """Whether laya_aot.load fetches or unpacks the bundle first (nothing to read here before it loads)."""
        return self.packed or self.bundle.startswith(HF_SCHEME)


@dataclass(frozen=True)
class ServeConfig:
    bundles: Dict[str, BundleSpec] = field(default_factory=dict)
    strict: bool = False
    near_ties: str = "off"  # runtime/backend.DEFAULT_NEAR_TIES (not imported here: torch loads lazily)
    batching: Optional[Limits] = field(default_factory=Limits)  # None: LAYA_AOT_BATCH=0, one request at a time
    metrics: bool = False  # LAYA_AOT_METRICS: GET /metrics
    lanes: int = 1  # calls the batcher runs at once (serve_batching.lanes_from_env: > 1 only over an engine)


def _json_object(env: Mapping[str, str], name: str, shape: str, example: str = _EXAMPLE) -> Dict[str, Any]:
    raw = env.get(name, "").strip()
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ServeConfigError("invalid %s: not JSON (%s); set it to a JSON object of %s, e.g. %s"
                               % (name, e, shape, example)) from None
    if not isinstance(data, dict):
        raise ServeConfigError("invalid %s: a JSON object of %s is needed, got a JSON %s; e.g. %s"
                               % (name, shape, type(data).__name__, example))
    return data


def _known_checkpoints(env: Mapping[str, str]) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """The names laya's Router will know (built-ins and LAYA_EXTRA_MODELS) -> their source, as the Router keys them,
    and each name -> the setting its source is changed by (`LAYA_EXTRA_MODELS['name']`, as written there).

    A LAYA_EXTRA_MODELS that is not a JSON object is refused here, by its name (laya would refuse it too; read as
    empty, it made every bundle's model look unknown)."""
    from laya.router import DEFAULT_MODELS, canonical_name

    known: Dict[str, Any] = dict(DEFAULT_MODELS)
    settings = {name: "LAYA_EXTRA_MODELS[%r]" % name for name in known}
    extra = _json_object(env, "LAYA_EXTRA_MODELS", "checkpoint name to checkpoint directory or Hub repo",
                         """'{"support": "/path/to/checkpoint"}'""")
    for name, source in extra.items():
        known[canonical_name(name)] = tuple(source) if isinstance(source, list) else source
        settings[canonical_name(name)] = "LAYA_EXTRA_MODELS[%r]" % name
    return known, settings


def _checkpoint_dir(model: str, source: Any, setting: str) -> Path:
    """The local directory a bundled checkpoint is read from: its LAYA_EXTRA_MODELS path, or the HF cache.
    `setting` names where the source came from, as the fix (`checkpoint.find`)."""
    from .checkpoint import CheckpointError, CheckpointNotFound, find

    repo, sub = (list(source) + [None])[:2] if isinstance(source, (list, tuple)) else (source, None)
    try:
        return find(str(repo), sub, setting)
    except CheckpointNotFound as e:  # names the setting to fix already
        raise ServeConfigError(str(e)) from None
    except CheckpointError as e:
        raise ServeConfigError("model %r has a bundle but its checkpoint cannot be read: %s" % (model, e)) from None


def _flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ServeConfigError("invalid %s %r: use 1 (on) or 0 (off)" % (name, env.get(name)))


def _near_ties(env: Mapping[str, str]) -> str:
    """LAYA_AOT_NEAR_TIES as a mode of runtime/backend.NEAR_TIE_MODES (1/0 read as call/off)."""
    from .runtime.backend import DEFAULT_NEAR_TIES, NEAR_TIE_MODES

    raw = env.get(ENV_NEAR_TIES, "").strip().lower()
    if raw in NEAR_TIE_MODES:
        return raw
    if not raw:
        return DEFAULT_NEAR_TIES
    if raw in _TRUE:
        return "call"
    if raw in _FALSE:
        return "off"
    raise ServeConfigError("invalid %s %r: use 0 (off, the default), call or rows"
                           % (ENV_NEAR_TIES, env.get(ENV_NEAR_TIES)))


def config_from_env(env: Optional[Mapping[str, str]] = None) -> ServeConfig:
    """Read and check the LAYA_AOT_* settings (bundles, strict, pins, near-ties) before anything loads."""
    from laya.router import canonical_name

    from .distribution import fetch
    from .manifest import MANIFEST

    env = os.environ if env is None else env
    strict = _flag(env, ENV_STRICT)
    raw = _json_object(env, ENV_BUNDLES, "model name to bundle directory")
    known, settings = _known_checkpoints(env)
    bundles: Dict[str, BundleSpec] = {}
    for name, bundle in raw.items():
        key = canonical_name(name)
        if key not in known:
            raise ServeConfigError(
                "invalid %s: no checkpoint is named %r; this server knows %s. Register a local checkpoint under "
                "that name with LAYA_EXTRA_MODELS='{\"%s\": \"/path/to/checkpoint\"}'"
                % (ENV_BUNDLES, name, ", ".join(sorted(known)), name))
        if key in bundles:
            raise ServeConfigError("invalid %s: %r and %r name the same checkpoint %r; keep one"
                                   % (ENV_BUNDLES, bundles[key].model, name, key))
        if not isinstance(bundle, str) or not bundle.strip():
            raise ServeConfigError("invalid %s: the bundle of %r must be a directory path (a string), got %r"
                                   % (ENV_BUNDLES, name, bundle))
        bundle = bundle.strip()
        packed = False
        if not bundle.startswith(HF_SCHEME):
            bundle = os.path.expanduser(bundle)
            packed = fetch.packed(Path(bundle))
            if not packed and os.path.exists(bundle) and not Path(bundle).is_dir():
                raise ServeConfigError("invalid %s: the bundle of %r, %s, is a file but not a pack (*%s); name a "
                                       "bundle directory, a pack or a directory of packs"
                                       % (ENV_BUNDLES, name, bundle, PACK_SUFFIX))
            if not packed and not Path(bundle).is_dir():
                raise ServeConfigError("invalid %s: bundle directory %s of %r does not exist; build it with "
                                       "`laya-aot build checkpoint.path=CHECKPOINT output_dir=%s`"
                                       % (ENV_BUNDLES, bundle, name, bundle))
            if not packed and not (Path(bundle) / MANIFEST).is_file():
                raise ServeConfigError("invalid %s: %s (the bundle of %r) has no %s, so it is not a finished "
                                       "bundle; build it with `laya-aot build ... output_dir=%s`"
                                       % (ENV_BUNDLES, bundle, name, MANIFEST, bundle))
        checkpoint = _checkpoint_dir(key, known[key], settings[key])
        bundles[key] = BundleSpec(model=key, bundle=bundle, checkpoint=checkpoint, packed=packed)
    pins = _json_object(env, ENV_PINS, "model name to sha256",
                        """'{"support": "<the sha256 `laya-aot inspect` prints>"}'""")
    if pins:
        _require_load_parameter("bundle_sha256", ENV_PINS)
    for name, sha in pins.items():
        key = canonical_name(name)
        if key not in bundles:
            raise ServeConfigError("invalid %s: %r has no bundle in %s; pin only bundled models (%s)"
                                   % (ENV_PINS, name, ENV_BUNDLES, ", ".join(sorted(bundles)) or "none"))
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", sha.strip()):
            raise ServeConfigError("invalid %s: the pin of %r must be 64 hex digits (the sha256 `laya-aot inspect` "
                                   "prints), got %r" % (ENV_PINS, name, sha))
        bundles[key] = dataclasses.replace(bundles[key], sha256=sha.strip().lower())
    single = env.get(ENV_PIN, "").strip()
    if single and not re.fullmatch(r"[0-9a-fA-F]{64}", single):
        raise ServeConfigError("invalid %s %r: a pin is 64 hex digits (the sha256 `laya-aot inspect` prints)"
                               % (ENV_PIN, single[:80]))
    if single and len(bundles) > 1:  # laya_aot.load would hold every bundle of this server to one manifest
        raise ServeConfigError("%s pins one bundle, and this server loads %d (%s); pin each with %s='{\"%s\": "
                               "\"<sha256>\", ...}' and unset %s" % (ENV_PIN, len(bundles), ", ".join(sorted(bundles)),
                                                                   ENV_PINS, sorted(bundles)[0], ENV_PIN))
    _check_load_settings(env)
    near_ties = _near_ties(env)
    batching = limits_from_env(env, ServeConfigError) if _flag(env, ENV_BATCH, default=True) else None
    return ServeConfig(bundles=bundles, strict=strict, near_ties=near_ties, batching=batching,
                       metrics=_flag(env, ENV_METRICS), lanes=lanes_from_env(env, ServeConfigError))


def _check_load_settings(env: Mapping[str, str]) -> None:
    """The settings each load reads later (the probe's switches and timeout, the unpack ratio, the cache
    directory), checked by their owners' readers as the server starts: a bad value stops it with one line, where a
    load would have fallen back to eager or read it as on."""
    from . import probe
    from .distribution.pack import max_ratio
    from .files import ENV_CACHE_DIR
    from .manifest import BundleError

    for name in (probe.ENV_AHEAD, probe.ENV_SHIPPED):
        _flag(env, name, default=True)
    try:
        probe.timeout_s(env)
        max_ratio(env)
    except (probe.SettingError, BundleError) as e:
        raise ServeConfigError(str(e)) from None
    cache = env.get(ENV_CACHE_DIR, "").strip()
    if cache and os.path.exists(os.path.expanduser(cache)) and not os.path.isdir(os.path.expanduser(cache)):
        raise ServeConfigError("invalid %s %r: it is a file; name a directory laya-aot may write its per-machine "
                               "cache in (probe verdicts, digests), or unset it" % (ENV_CACHE_DIR, cache))


def _require_load_parameter(name: str, setting: str) -> None:
    from .runtime.loader import load

    if name not in inspect.signature(load).parameters:
        raise ServeConfigError("%s needs a laya_aot.load that takes %s=, and this laya-aot's does not; upgrade "
                               "laya-aot or unset %s" % (setting, name, setting))


def precheck(spec: BundleSpec, device: Optional[str] = None) -> Tuple[Optional[str], List[str]]:
    """Why `spec`'s bundle cannot serve its checkpoint, from its manifest alone (None: it may), and 'name: reason'
    of each artifact this process's software refuses on `device` (default: `usable.default_device()`; see
    `usable.refused_for_software`): a start-time check for a checkpoint that loads only on first use. The load
    repeats it and checks everything else."""
    from . import kinds
    from .bundle_format import read_bundle
    from .checkpoint import mismatch, read_config
    from .kinds.usable import here, refused_for_software
    from .manifest import BundleError

    try:
        kw = {"sha256": spec.sha256} if spec.sha256 else {}
        manifest = read_bundle(spec.bundle, kinds.BY_NAME, **kw)
    except BundleError as e:
        return str(e), []
    why = mismatch(manifest, spec.checkpoint)
    if why is not None:
        return "%s; rebuild it with `laya-aot build checkpoint.path=%s`" % (why, spec.checkpoint), []
    refused = refused_for_software(manifest.artifacts, here(read_config(spec.checkpoint), device))
    return None, ["%s: %s" % kv for kv in refused]


def describe(agent: Any) -> Dict[str, Any]:
    """What serves a loaded agent: its backend, the artifact and variant (None: laya's eager forward) and every
    artifact of the bundle that was not used, with the loader's reason."""
    backend = getattr(agent, "backend_object", None)
    remote = getattr(backend, "described", None)
    if remote is not None:  # a worker's agent whose artifact runs in the engine (runtime/engine.py): as it said
        return dict(remote, backend=getattr(agent, "backend", None), calls=getattr(backend, "stats", {}))
    art = getattr(backend, "artifact", None)
    out: Dict[str, Any] = {"backend": getattr(agent, "backend", None), "artifact": getattr(art, "name", None)}
    if art is not None:
        out["variant"] = getattr(backend, "variant", None)
        verify = getattr(backend, "verify", None)
        # the artifact's verified margin, whether or not a near-tie mode uses it (near_ties says which)
        out["near_tie_margin"] = verify.tie_margin() if verify is not None else None
        out["near_ties"] = getattr(backend, "near_ties", None)
        decisions = getattr(verify, "decisions", None)
        out["decisions"] = dataclasses.asdict(decisions) if decisions is not None else None
        # runtime/handover.py: the best mix taking over (or having taken over) from the artifact that started
        out["handover"] = dict((getattr(backend, "load_stats", None) or {}).get("handover") or {}) or None
        # artifact calls, pieces, calls padded to a CUDA graph's shape, and the graphs captured, replayed, dropped
        out["calls"] = {k: v for k, v in (getattr(backend, "stats", None) or {}).items() if k != "host_path"}
    out["refused"] = ["%s: %s" % (name, why) for name, why in (getattr(backend, "rejected", None) or [])]
    return out


def _pin_words(spec: BundleSpec, text: str) -> str:
    """`text` with the loader's name for a pin replaced by the setting this server read it from."""
    if spec.sha256 is None:
        return text
    from .bundle_format import PIN_SETTING

    return text.replace(PIN_SETTING, "%s[%r]" % (ENV_PINS, spec.model))


def _unexamined(spec: BundleSpec, agent: Any, info: Dict[str, Any]) -> List[str]:
    """'name: reason' for each artifact the load never examined (it stopped at the first that serves) that would
    serve this agent here but is refused for this process's software (another torch than the build's: the reason
    names the fix, `usable.refused_for_software`), or whose files do not match the manifest: a damaged bundle or
    a torch that disqualifies the fastest artifact is named at the first load, not when the artifact serving
    fails. Digests are cached, so this is a few stats."""
    from . import kinds
    from .bundle_format import check_artifact_hash, read_bundle
    from .kinds.usable import Here, refused_for_software
    from .manifest import BundleError
    from .variant import current_machine

    examined = {info["artifact"]} | {r.split(": ", 1)[0] for r in info["refused"]}
    try:
        manifest = read_bundle(spec.bundle, kinds.BY_NAME, **({"sha256": spec.sha256} if spec.sha256 else {}))
    except BundleError:
        return []  # the load read this manifest; a change since is the next load's to report
    here = Here(str(agent.device), agent.device.type, current_machine(str(agent.device)),
                laya_api.serving_dtype(agent))
    others = [art for art in manifest.artifacts if art.name not in examined]
    out = ["%s: %s" % kv for kv in refused_for_software(others, here)]
    for art in others:
        why = check_artifact_hash(spec.bundle, art) if here.reject_reason(art) is None else None
        if why is not None:
            out.append("%s: %s" % (art.name, why))
    return out


class BundleLoads:
    """The Router's build step for bundled checkpoints: `laya_aot.load`, one log line per load, a load count."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.loads: Counter = Counter()
        self.unexamined: Dict[str, List[str]] = {}  # per checkpoint, from its last load: see _unexamined
        self.started = False  # a load that fails before the server started is reported once, by create_app's caller
        self._lock = threading.Lock()

    def __call__(self, router: Any, key: str, laya_build: Callable[[], Any]) -> Any:
        spec = self.config.bundles.get(key)
        if spec is None:
            return laya_build()
        from .runtime.loader import NoArtifactError

        kwargs = laya_api.router_agent_kwargs(router, key)
        if spec.sha256:
            kwargs["bundle_sha256"] = spec.sha256
        with self._lock:
            self.loads[key] += 1
            n = self.loads[key]
        t0 = time.perf_counter()
        try:
            agent = self._build(key, spec, kwargs)
        except NoArtifactError as e:
            message = _pin_words(spec, str(e))
            if self.started:
                log.error("%r load #%d from bundle %s failed (%s=1): %s", key, n, spec.bundle, ENV_STRICT, message)
            raise NoArtifactError(message) from None
        except Exception as e:
            if self.started:
                log.error("%r load #%d from bundle %s failed: %s", key, n, spec.bundle, e)
            raise
        took = time.perf_counter() - t0
        info = describe(agent)
        remote = spec.remote or hasattr(agent.backend_object, "described")  # the engine examined the bundle
        unexamined = [] if remote or info["artifact"] is None else _unexamined(spec, agent, info)
        with self._lock:
            self.unexamined[key] = unexamined
        refused = "; ".join(_pin_words(spec, r) for r in info["refused"] + unexamined)
        if info["artifact"] is not None:
            (log.warning if refused else log.info)(
                "%r load #%d in %.2f s: served by %s (artifact %s, %s) from bundle %s%s%s", key, n, took,
                info["backend"], info["artifact"], info["variant"], spec.bundle,
                "; %s takes over once loaded (GET /v1/aot: handover)" % info["handover"]["to"]
                if info["handover"] else "", "; not used: %s" % refused if refused else "")
        else:
            log.warning("%r load #%d in %.2f s: fell back to laya's eager forward; no artifact of "
                        "bundle %s fits: %s", key, n, took, spec.bundle, refused)
        return agent

    def _build(self, key: str, spec: BundleSpec, kwargs: Dict[str, Any]) -> Any:
        """`laya_aot.load` here, or, in a worker of a server with an engine, a thin agent whose forward runs there
        (the engine loads the checkpoint as this would; its refusal under strict is this load's)."""
        from .runtime import engine
        from .runtime.loader import NoArtifactError, load

        remote = engine.client()
        if remote is None:
            return load(str(spec.checkpoint), bundle=spec.bundle, strict=self.config.strict,
                        near_ties=self.config.near_ties, **kwargs)
        request = {k: v for k, v in kwargs.items() if k != "bundle_sha256"}
        try:
            return engine.remote_agent(remote, key, str(spec.checkpoint), request,
                                       {k: v for k, v in request.items() if k != "device"})
        except engine.EngineError as e:
            if str(e).startswith("NoArtifactError: "):
                raise NoArtifactError(str(e)[len("NoArtifactError: "):]) from None
            raise

    def report(self, router: Any) -> Dict[str, Any]:
        """`GET /v1/aot`'s answer (less the batcher's entry, which AotRoute adds): every resident checkpoint's
        backend, and every bundled checkpoint's bundle, load count and, when resident, what serves it and why each
        other artifact was not used."""
        backends: Dict[str, Any] = {}
        bundles: Dict[str, Any] = {}
        for name in list(getattr(router, "loaded", None) or []):
            agent = laya_api.resident_agent(router, name)
            if agent is not None:
                backends[name] = describe(agent)["backend"]
        for name, spec in self.config.bundles.items():
            entry: Dict[str, Any] = {"bundle": spec.bundle, "loads": self.loads[name], "resident": name in backends}
            agent = laya_api.resident_agent(router, name) if name in backends else None
            if agent is not None:
                info = describe(agent)
                info["refused"] = [_pin_words(spec, r) for r in info["refused"] + self.unexamined.get(name, [])]
                entry.update(info)
            bundles[name] = entry
        return {"backends": backends, "bundles": bundles, "strict": self.config.strict,
                "near_ties": self.config.near_ties}


AOT_ROUTE = "/v1/aot"
_DENIED = b'{"detail":"invalid or missing bearer token"}'  # laya's 401 body on its other routes
_METHODS = ("GET", "HEAD")  # what AotRoute's routes answer; any other method: 405, FastAPI's body and Allow
_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'


WATCH_AFTER_S = 0.01  # a request answered sooner has no watcher: a task for each request cost 30-60 us of its host time


async def dropped_when_gone(app: Any, scope: Dict[str, Any], receive: Any, send: Any) -> None:
    """laya's app for one request, cancelled if its client disconnects before the answer starts: uvicorn does not
    cancel a handler whose client went away (its `receive()` only answers `http.disconnect`), so a request queued
    for the batcher would be computed for no one. Cancelled, laya's wait on the pool's future cancels the batcher's
    future: a request not yet in a call is dropped (`refused: cancelled`); one whose call runs is computed with it
    and its answer discarded. The body is laya's to read; the connection is watched from WATCH_AFTER_S after it
    (a disconnect before then is seen at once then), or as soon as laya asks for more."""
    import asyncio

    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    gone = asyncio.Event()
    body_read = started = False
    watcher: Optional[Any] = None
    timer: Optional[Any] = None

    async def watch() -> None:
        if (await receive())["type"] == "http.disconnect":
            gone.set()
            if not started and task is not None:
                task.cancel()

    def start_watching(asked: bool = False) -> None:
        nonlocal watcher
        if watcher is None and (asked or not started):
            watcher = loop.create_task(watch())

    async def receive_body() -> Dict[str, Any]:
        nonlocal body_read, timer
        if body_read:  # what comes after the body is the disconnect, which the watcher takes
            start_watching(asked=True)
            await gone.wait()
            return {"type": "http.disconnect"}
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
        elif not message.get("more_body", False):
            body_read = True
            timer = loop.call_later(WATCH_AFTER_S, start_watching)
        return message

    async def sending(message: Dict[str, Any]) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, receive_body, sending)
    except asyncio.CancelledError:
        if not gone.is_set() or started:
            raise
        uncancel = getattr(task, "uncancel", None)  # Python 3.11: the cancel was this function's own
        if uncancel is not None:
            uncancel()
    finally:
        if timer is not None:
            timer.cancel()
        if watcher is not None:
            watcher.cancel()


class AotRoute:
    """ASGI middleware answering `GET /v1/aot` (and, with LAYA_AOT_METRICS=1, `GET /metrics`); every other request
    goes to laya's app untouched, once the batcher has its place in it (`ServeBatching.ensure`).

    Who may read them is laya's decision: the caller's headers are sent to laya's own `GET /health`, and a caller
    laya shows its detail to (the answer lists `loaded`) gets the report; any other gets 401, as laya answers an
    unauthorised caller on its other routes. A middleware, not a route: laya's app, its OpenAPI schema
    included, stays laya's."""

    def __init__(self, app: Any, router: Any, loads: BundleLoads, batching: Optional[ServeBatching] = None,
                 board: Optional[serve_workers.Board] = None):
        self.app, self.router, self.loads, self.batching, self.board = app, router, loads, batching, board
        self.routes = (AOT_ROUTE, METRICS_ROUTE) if batching is not None and batching.metrics else (AOT_ROUTE,)
        if board is not None and batching is not None:  # one of several workers: its figures for the others
            board.start(self._own_figures)

    def _route(self, scope) -> Optional[str]:
        """Which of this middleware's routes the request's path names, whatever its method (None: laya's)."""
        if scope["type"] != "http":
            return None
        path = scope.get("path", "")
        for route in self.routes:
            if path in (route, scope.get("root_path", "") + route):
                return route
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.batching is not None:
            self.batching.ensure()
        route = self._route(scope)
        batched = self.batching is not None and self.batching.enabled
        if route is None and batched and scope["type"] == "http" and scope.get("method") == "POST":
            await dropped_when_gone(self.app, scope, receive, send)
            return
        if route is None:
            await self.app(scope, receive, send)
            return
        if scope.get("method") not in _METHODS:  # as FastAPI answers a method laya's route does not take
            await send({"type": "http.response.start", "status": 405,
                        "headers": [(b"allow", ", ".join(_METHODS).encode()), (b"content-type", b"application/json"),
                                    (b"content-length", str(len(_NOT_ALLOWED)).encode())]})
            await send({"type": "http.response.body", "body": _NOT_ALLOWED})
            return
        path = scope["path"]
        health_path = path[:-len(route)] + "/health"  # under laya's LAYA_ROOT_PATH as this request is
        health = dict(scope, method="GET", path=health_path, raw_path=health_path.encode(), query_string=b"")
        start: Dict[str, Any] = {}
        body: List[bytes] = []

        async def capture(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                body.append(message.get("body", b""))

        await self.app(health, receive, capture)
        try:
            detail = json.loads(b"".join(body)) if start.get("status") == 200 else None
        except ValueError:
            detail = None
        ctype = b"application/json"
        if not (isinstance(detail, dict) and isinstance(detail.get("loaded"), list)):
            status, payload = 401, _DENIED
        elif route == METRICS_ROUTE:
            status, ctype = 200, b"text/plain; version=0.0.4; charset=utf-8"
            payload = self.batching.metrics_text(self._figures()).encode()  # type: ignore[union-attr]
        else:
            report = self.loads.report(self.router)
            if self.batching is not None:
                report["batching"] = self.batching.report()
                if self.board is not None:
                    report.update(serve_workers.report(self.board, self._figures()))
            status, payload = 200, json.dumps(report, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload if scope.get("method") == "GET" else b""})

    def _own_figures(self) -> Dict[str, Any]:
        return self.batching.figures(self._backends(), dict(self.loads.loads))  # type: ignore[union-attr]

    def _figures(self) -> List[Dict[str, Any]]:
        """This process's figures, and, in one of several workers, every other worker's latest."""
        own = self._own_figures()
        return self.board.gather(own) if self.board is not None else [own]

    def _backends(self) -> Dict[str, Dict[str, Any]]:
        """What serves each resident checkpoint (its backend and artifact), for /metrics."""
        out = {}
        for name in list(getattr(self.router, "loaded", None) or []):
            agent = laya_api.resident_agent(self.router, name)
            if agent is not None:
                info = describe(agent)
                out[name] = {"backend": info["backend"], "artifact": info["artifact"]}
        return out


def create_app(router: Any = None, config: Optional[ServeConfig] = None) -> Any:
    """laya's FastAPI app over a Router that loads bundled checkpoints through `laya_aot.load`, plus `GET /v1/aot`.

    Builds the Router as `laya serve` does (preloading unless LAYA_PRELOAD=0); a bundled checkpoint not
    loaded at start is pre-checked from its manifest, and under LAYA_AOT_STRICT a failed check refuses.
    `router` is laya's own parameter: an injected Router (a test's, an embedding's) is served as it is."""
    laya_api.require("serve")
    missing = laya_api.check(routes=("core", "serve"))
    if missing:
        raise laya_api.LayaIncompatible(missing, "laya-aot serve")
    import laya.serve

    config = config_from_env() if config is None else config
    loads = BundleLoads(config)
    # a fallback's warning from laya_aot.load is that load's log line (BundleLoads), said once
    warnings.filterwarnings("ignore", message="laya-aot: using laya's eager forward", category=RuntimeWarning,
                            module=re.escape(__name__))
    if router is None and config.bundles:
        for spec in config.bundles.values():
            log.info("%r <- bundle %s (checkpoint %s)%s", spec.model, spec.bundle, spec.checkpoint,
                     ", strict" if config.strict else "")
        router = _laya_router(laya_api.aot_router_class(loads))
        _precheck_lazy(router, config)
    elif router is None:  # no bundle: laya's own Router, built as laya's create_app builds it
        router = _laya_router(None)
    app = laya.serve.create_app(router=router)
    batching = ServeBatching(app, config.batching, metrics=config.metrics, lanes=config.lanes)
    if batching.enabled:
        log.info("batching concurrent requests: %s", ", ".join("%s=%s" % kv for kv in vars(config.batching).items()))
    app.add_middleware(AotRoute, router=router, loads=loads, batching=batching, board=serve_workers.board())
    loads.started = True
    return app


def _laya_router(router_class: Optional[type]) -> Any:
    """`laya_api.build_router`: laya reads its own LAYA_* settings there, and a ValueError is its refusal of one
    (`LAYA_MODELS=nosuch`, `LAYA_DEVICE=banana`), whose message names it: one line, as laya-aot's own settings
    (the traceback at debug level)."""
    try:
        return laya_api.build_router(router_class)
    except ValueError as e:
        log.debug("laya refused its settings", exc_info=True)
        raise ServeConfigError("laya refused its settings: %s" % e) from e


def _precheck_lazy(router: Any, config: ServeConfig) -> None:
    """Bundled checkpoints that load on first use: their manifest checked now (under strict, a failure refuses),
    and any artifact this process's torch refuses named now, with the fix."""
    resident = set(router.loaded)
    for spec in config.bundles.values():
        if spec.model in resident:
            continue
        why, refused = (None, []) if spec.remote else precheck(spec, getattr(router, "device", None))
        why = None if why is None else _pin_words(spec, why)
        if why is not None and config.strict:
            raise ServeConfigError("bundle %s cannot serve %r (%s=1): %s" % (spec.bundle, spec.model, ENV_STRICT, why))
        if why is not None:
            log.warning("%r loads on first use and will fall back to laya's eager forward: %s",
                        spec.model, why)
        else:
            (log.warning if refused else log.info)(
                "%r loads on first use from bundle %s (%s)%s", spec.model, spec.bundle,
                "fetched by laya_aot.load" if spec.remote else "manifest checked, built from this checkpoint",
                "; not usable with this process's software: %s" % "; ".join(refused) if refused else "")


def _setup_logging() -> None:
    """Plain lines on stderr beside uvicorn's (a server log is read by grep, not a terminal)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s:     %(name)s: %(message)s", stream=sys.stderr,
                        force=True)
    log.setLevel(logging.INFO)


def _engine_main() -> int:
    """The engine process of a server with LAYA_AOT_ENGINE=1: loads the bundled checkpoints the workers ask for,
    with `laya_aot.load` as one process would (the workers' agent settings, this server's bundles, pins, strict
    and near-ties), and runs their artifact calls on the device."""
    from .runtime import engine
    from .runtime.loader import load

    config = config_from_env()

    def load_one(model: str, request: Dict[str, Any]) -> Any:
        spec = config.bundles[model]
        pin = {"bundle_sha256": spec.sha256} if spec.sha256 else {}
        agent = load(str(spec.checkpoint), bundle=spec.bundle, strict=config.strict, near_ties=config.near_ties,
                     **pin, **request)
        info = describe(agent)
        log.info("engine: %r served by %s (artifact %s)", model, info["backend"], info["artifact"])
        return agent

    return engine.serve_engine(engine.Engine(load_one, describe))


def main(argv: List[str], start: float) -> int:
    """`laya-aot serve`: configuration errors are one line and exit 2, never a traceback."""
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv:
        print("laya-aot serve takes no arguments (it is configured by environment, as laya serve is): %s\n\n%s"
              % (" ".join(argv), USAGE), file=sys.stderr)
        return 2
    _setup_logging()
    try:
        laya_api.require("serve")  # before anything loads: a missing extra is one line naming it
    except laya_api.RouteUnavailable as e:
        print("laya-aot serve: %s" % e, file=sys.stderr)
        return 2
    from .runtime.loader import NoArtifactError

    try:
        switch = serve_workers.switch_interval_from_env(os.environ, ServeConfigError)
    except ServeConfigError as e:
        print("laya-aot serve: %s" % e, file=sys.stderr)
        return 2
    if switch is not None:
        sys.setswitchinterval(switch)
    if os.environ.get("LAYA_AOT_ENGINE_READY_FD"):  # run by the supervisor as the engine (runtime/engine.py)
        return _engine_main()
    app = None
    try:
        host, port, level = laya_api.serve_settings()
        workers = serve_workers.count_from_env(os.environ, ServeConfigError)  # a worker's own environment says 1
        engine = _flag(os.environ, ENV_ENGINE)
        if engine and workers == 1 and serve_workers.this_worker() is None:
            log.warning("%s=1 is for several workers (%s > 1): one process runs its artifact calls itself",
                        ENV_ENGINE, serve_workers.ENV_WORKERS)
        if workers > 1:  # the settings' mistakes said once, here, before any worker starts
            config_from_env()
        else:  # one process: a taken port said before the models load (a worker's supervisor checked it)
            refused = None if serve_workers.this_worker() else serve_workers.refuse_taken_port(host, port)
            if refused is not None:
                return refused
            app = create_app()
    except (ServeConfigError, NoArtifactError, laya_api.LayaIncompatible) as e:
        # the loader's own messages start "laya-aot: " (a warning's prefix): said once, as this command's
        print("laya-aot serve: %s" % re.sub(r"^laya-aot: ", "", str(e)), file=sys.stderr)
        return 2
    except SystemExit as e:  # laya's own refusals (LAYA_EXTRA_MODELS, LAYA_PORT, ...) carry their message
        if isinstance(e.code, str):
            print("laya-aot serve: %s" % e.code, file=sys.stderr)
            return 2
        raise
    if app is None:
        return serve_workers.supervise(workers, host, port, engine=engine)
    worker = serve_workers.this_worker()
    log.info("ready %.1f s after process start, on %s:%d%s", time.perf_counter() - start, host, port,
             " (worker %d of %d)" % (worker[0] + 1, worker[1]) if worker else "")
    if worker:
        return serve_workers.run_worker(app, host, port, level)
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=level)
    return 0
