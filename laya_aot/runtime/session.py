"""One load's typed state: what the caller asked (`LoadConfig`), the bundle read once (`OpenedBundle`), the start
order made once (`select.select`), the checkpoint's fit judged once, every refusal with its reason, and what the
load cost (`LoadStats`).

`loader.load` makes one `LoadSession` and hands it to all that takes part in a start: the head start
(runtime/head_start.py), the tokenizer's seeding (`loader._Seed`), each candidate's checks (runtime/trial.py) and a
hand-over. Whichever of their threads asks first for the manifest, the start order or the fingerprint's verdict
computes it; the others wait for that one value. This module imports no torch: what needs only paths and bytes
(`LoadSession.open`: the checkpoint's path, the bundle's bytes, the pin, the small files of another checkpoint)
answers before any heavy import.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Generic, List, Optional, Tuple, TypeVar

from .. import checkpoint as ckpt_mod
from ..bundle_format import parse, read_pinned
from ..manifest import MANIFEST, Bundle, BundleError, check_schema, is_sha256, unsafe_relpath
from ..padding import CHUNK_TOKENS

log = logging.getLogger(__name__)

T = TypeVar("T")

# who decides a row whose top two options are within the artifact's tie margin (runtime/backend.py)
NEAR_TIE_MODES = ("call", "rows", "off")
# off: every answer is the artifact's, whose agreement with fp32 was measured against laya's own in the same dtype
DEFAULT_NEAR_TIES = "off"
# when the loader builds laya's eager module (`LoadConfig.eager_module`)
EAGER_MODULE_MODES = ("lazy", "background", "now")
PIN_ENV = "LAYA_AOT_BUNDLE_SHA256"


def near_tie_mode(value: Any) -> str:
    """One of NEAR_TIE_MODES; True/False are "call"/"off" (the switch's first form: on or off)."""
    if value is True or value is False:
        return "call" if value else "off"
    if isinstance(value, str) and value in NEAR_TIE_MODES:
        return value
    raise ValueError("near_ties=%r is not a near-tie mode; use %s (or True/False)"
                     % (value, ", ".join(repr(m) for m in NEAR_TIE_MODES)))


@dataclass(frozen=True)
class LoadConfig:
    """How `laya_aot.load` loads a checkpoint with a bundle: every keyword of `load` but laya's own (`load` documents
    each). `laya_aot.load(ckpt, bundle, config=LoadConfig(strict=True, prefer="aoti"))` is
    `laya_aot.load(ckpt, bundle, strict=True, prefer="aoti")`."""

    device: Optional[str] = None
    prefer: Optional[str] = None
    strict: bool = False
    probe: bool = True
    smoke_check: bool = True
    cuda_graphs: bool = True
    bundle_sha256: Optional[str] = None
    near_ties: bool | str = DEFAULT_NEAR_TIES
    eager_module: str = "lazy"
    host_path: bool = True
    chunk_tokens: int = CHUNK_TOKENS
    handover: bool = True

    def checked(self) -> "LoadConfig":
        """The caller's mistakes (not the bundle's) as TypeError or ValueError; the config with `near_ties` as its
        mode. `prefer` is checked against the kinds only when given (the kinds' registry imports torch)."""
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 0:
            raise ValueError("chunk_tokens=%r is not a token count; use a whole number >= 0 (0: no token budget)"
                             % (self.chunk_tokens,))
        if self.prefer is not None:
            from .. import kinds

            if self.prefer not in kinds.RUNTIME_ORDER:
                raise ValueError("prefer=%r is not an artifact kind; use one of %s"
                                 % (self.prefer, ", ".join(kinds.RUNTIME_ORDER)))
        mode = near_tie_mode(self.near_ties)
        if self.eager_module not in EAGER_MODULE_MODES:
            raise ValueError("eager_module=%r is not one of %s" % (self.eager_module, ", ".join(EAGER_MODULE_MODES)))
        return dataclasses.replace(self, near_ties=mode)

    @property
    def pin(self) -> Optional[str]:
        """The bundle's pin: `bundle_sha256`, else $LAYA_AOT_BUNDLE_SHA256 (None: unpinned)."""
        if self.bundle_sha256 is not None:
            return self.bundle_sha256
        return os.environ.get(PIN_ENV) or None


def config_of(config: Optional[LoadConfig], **given: Any) -> LoadConfig:
    """`config`, or the one `load`'s keywords make; a keyword given beside `config` with another value than its
    default is a TypeError (which of the two would hold is not for the loader to guess)."""
    if config is None:
        return LoadConfig(**given)
    if not isinstance(config, LoadConfig):
        raise TypeError("config=%r is not a laya_aot.LoadConfig" % (config,))
    defaults = LoadConfig()
    clash = sorted(k for k, v in given.items() if v != getattr(defaults, k))
    if clash:
        raise TypeError("load() got config= and %s: pass them in the LoadConfig (dataclasses.replace(config, %s=...))"
                        % (", ".join(clash), clash[0]))
    return config


class _Once(Generic[T]):
    """A value made once, by whichever thread asks first, while the others wait for it; an exception is kept and
    raised to every asker."""

    def __init__(self, make: Callable[[], T]):
        self._make = make
        self._lock = threading.Lock()
        self._done = False
        self._value: Optional[T] = None
        self._error: Optional[BaseException] = None

    def get(self) -> T:
        with self._lock:
            if not self._done:
                try:
                    self._value = self._make()
                except Exception as e:  # noqa: BLE001 - kept for every asker, raised to each
                    self._error = e
                self._done = True
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


class OpenedBundle:
    """A bundle directory's bundle.json, read once: its bytes (under the pin, if any), their sha256, the JSON
    parsed once, and the typed manifest, read strictly on first use (`manifest`: the kinds' own checks of their
    entries need the kinds' registry, which imports torch)."""

    def __init__(self, path: Path, pin: Optional[str]):
        self.path = path
        self.pinned = pin is not None
        self.source = str(path / MANIFEST)
        raw = read_pinned(path, pin)
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self._data = parse(raw, self.source)
        check_schema(self._data, self.source)
        self._manifest: _Once[Bundle] = _Once(self._read)

    def _read(self) -> Bundle:
        from .. import kinds

        return Bundle.from_dict(self._data, kinds.BY_NAME, self.source)

    @property
    def manifest(self) -> Bundle:
        """The typed manifest (`manifest.Bundle.from_dict`, strict); a BundleError names what is wrong."""
        return self._manifest.get()

    def recorded_files(self) -> Optional[Dict[str, str]]:
        """The checkpoint files' sha256 the manifest records, as the JSON holds them, for the check of milliseconds
        `LoadSession.open` makes before the strict reader runs (None: not as a build writes them; the reader
        says what is wrong)."""
        fp = self._data.get("checkpoint", {})
        fp = fp.get("fingerprint") if isinstance(fp, dict) else None
        files = fp.get("files") if isinstance(fp, dict) else None
        if not isinstance(files, dict) or not files or not all(
                isinstance(k, str) and not unsafe_relpath(k) and isinstance(v, str) and is_sha256(v)
                for k, v in files.items()):
            return None
        return files


@dataclass
class LoadStats:
    """What the load itself cost and decided; `agent.backend_object.load_stats` is `as_dict()` with the serving
    artifact's own figures (its hash, probe, load, checks: runtime/trial.py) beside them."""

    agent_load_s: Optional[float] = None      # laya's agent, from load()'s start
    thin_agent: bool = False                  # laya's module left unbuilt (runtime/eager_module.py)
    select_s: Optional[float] = None          # from the agent to an artifact serving (or none)
    fingerprint_s: Optional[float] = None     # waiting for the checkpoint's fingerprint after laya's load
    serving_dtype: Optional[str] = None       # what laya serves the checkpoint in here
    tokenizer_snapshot: Optional[str] = None  # where a first start's tokenizer snapshot came from (`loader._Seed`)
    ranking: Optional[str] = None             # whose latencies ranked the artifacts (`select.StartOrder.ranking`)
    start_costs_here_s: Optional[Dict[str, float]] = None  # the starts recorded here (`start_costs.known`)
    extra: Dict[str, Any] = field(default_factory=dict)    # a fall-back's eager module figures

    def as_dict(self) -> Dict[str, Any]:
        """The figures as a plain dict (what users read), those never set left out."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "extra" and getattr(self, f.name) is not None}
        out.update(self.extra)
        return out


class LoadSession:
    """One call of `laya_aot.load`: the checkpoint, the bundle (None: none usable), the config, the reasons each
    artifact (or the whole bundle) was refused, the stats; the manifest, the start order and the fingerprint's
    verdict each made once for all who take part (module docstring)."""

    def __init__(self, ckpt: Path, bundle: Optional[OpenedBundle], config: LoadConfig,
                 rejected: Optional[List[Tuple[str, str]]] = None, bundle_name: Any = None):
        self.ckpt = ckpt
        self.bundle = bundle
        self.bundle_name = bundle_name if bundle_name is not None else (bundle.path if bundle else None)
        self.config = config
        self.rejected: List[Tuple[str, str]] = list(rejected or [])
        self.stats = LoadStats()
        self._here: _Once[Any] = _Once(self._make_here)
        self._order: _Once[Any] = _Once(lambda: self._make_order(self.here()))
        self._mismatch: _Once[Optional[str]] = _Once(lambda: ckpt_mod.mismatch(self.manifest, self.ckpt))

    @classmethod
    def open(cls, checkpoint: str | os.PathLike, bundle: Any, config: LoadConfig) -> "LoadSession":
        """The checks that need no heavy import: the checkpoint's path (a CheckpointNotFound), the bundle's address
        (fetched or unpacked where it is one), its bytes under the pin, their JSON, and the small files of the
        checkpoint it records (a bundle of another architecture or tokenizer). What is wrong with the bundle is a
        reason in `rejected` (the caller falls back, or raises with `strict`)."""
        from ..distribution.fetch import resolve_for_load

        if bundle is not None and not isinstance(bundle, (str, os.PathLike)):
            raise TypeError("bundle=%s is not a path (its type is %s); pass bundle= a bundle directory (written by "
                            "`laya-aot build`), a pack, a directory of packs or an hf:// address, as a str or "
                            "os.PathLike" % (repr(bundle)[:60], type(bundle).__name__))
        ckpt = ckpt_mod.locate(str(checkpoint))
        pin = config.pin
        if bundle is None or not str(bundle):
            return cls(ckpt, None, config, [("bundle", "no bundle was given (bundle=%r); pass bundle=DIR, a "
                                                      "directory written by `laya-aot build`" % (bundle,))], bundle)
        if pin is not None and not is_sha256(str(pin).strip().lower()):
            return cls(ckpt, None, config, [("bundle", "the pin %r (bundle_sha256 or LAYA_AOT_BUNDLE_SHA256) is "
                                                       "not a sha256 (64 hex digits); `laya-aot inspect BUNDLE` "
                                                       "prints the bundle's" % str(pin)[:80])], bundle)
        local, not_fetched = resolve_for_load(bundle, config.device, ckpt)
        if not_fetched:
            return cls(ckpt, None, config, [("bundle", not_fetched)], bundle)
        try:
            opened = OpenedBundle(Path(local), pin)
        except BundleError as e:
            return cls(ckpt, None, config, [("bundle", str(e))], local)
        session = cls(ckpt, opened, config)
        eager_only = ckpt_mod.eager_only(ckpt)
        if eager_only:  # before the files' comparison: no rebuild can serve this checkpoint, its fix would mislead
            session.refuse(eager_only)
            return session
        recorded = opened.recorded_files()
        differ = ckpt_mod.differing_small_files(ckpt, recorded) if recorded else []
        if differ:
            session.refuse_other_checkpoint("it was built from another checkpoint than %s (differing: %s)"
                                            % (ckpt, ", ".join(differ[:5])))
        return session

    def refuse(self, why: str) -> None:
        """No artifact of the bundle may serve this agent: `why` is the bundle's reason."""
        self.rejected.append(("bundle", why))

    def refuse_other_checkpoint(self, why: str) -> None:
        """The bundle was not built from this checkpoint (`why`, in `checkpoint.mismatch`'s words): refused, with the
        fix."""
        self.refuse("%s; its artifacts would give wrong answers: rebuild it with `laya-aot build checkpoint.path=%s`"
                    % (why, self.ckpt))

    @property
    def usable(self) -> bool:
        """Whether the bundle may still serve (nothing refused it as a whole)."""
        return self.bundle is not None and not any(name == "bundle" for name, _ in self.rejected)

    @property
    def pinned(self) -> bool:
        """The pin held on the bytes the manifest was read from: a shipped probe verdict may serve."""
        return self.bundle is not None and self.bundle.pinned

    @property
    def manifest(self) -> Bundle:
        assert self.bundle is not None, "no bundle: nothing to read"
        return self.bundle.manifest

    def mismatch(self) -> Optional[str]:
        """`checkpoint.mismatch` of the manifest and the checkpoint, computed once (seconds for large weights never
        hashed here: the head start's thread asks first, beside laya's load)."""
        return self._mismatch.get()

    def _make_here(self) -> Any:
        from ..kinds.usable import here

        return here(ckpt_mod.read_config(self.ckpt), self.config.device)

    def here(self) -> Any:
        """`usable.Here` for this load (device, machine, serving dtype), from the checkpoint's config: what laya
        will serve in once the agent exists."""
        return self._here.get()

    def _make_order(self, here: Any) -> Any:
        from .select import select

        return select(self.manifest.artifacts, here, self.config.prefer, self.config.handover,
                      bundle_sha256=self.bundle.sha256 if self.bundle else None)

    def order(self, agent: Any = None) -> Any:
        """The start order (`select.select`), made once. Given the agent, its device and serving dtype must be those
        it was made for; should laya have chosen others, the order is made again for the agent's."""
        order = self._order.get()
        if agent is None:
            return order
        from .. import laya_internals as laya_api

        here = order.here
        serving = laya_api.serving_dtype(agent)
        if agent.device.type == here.device_type and serving == here.serving:
            return order
        from ..kinds.usable import Here
        from ..variant import current_machine

        log.info("laya-aot: laya serves %s in %s on %s, not %s on %s as its config said: the start order is made "
                 "for the agent", self.ckpt, serving, agent.device, here.serving, here.device)
        return self._make_order(Here(str(agent.device), agent.device.type, current_machine(str(agent.device)),
                                     serving))

    def reasons(self) -> str:
        """Every reason, one after another (for the warning or the error when nothing serves)."""
        return "; ".join("%s: %s" % (name, why) for name, why in self.rejected) or "the bundle lists no artifacts"
