"""One load's typed values: what the caller asked (`LoadConfig`), the bundle read once (`OpenedBundle`), what the
load cost (`LoadStats`), a value made once for every thread that asks (`_Once`), and what the load's leaves read of
it (`LoadView`, which `loader.LoadSession` is). This module imports no torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Generic, List, Optional, Protocol, Tuple, TypeVar

from ..bundle_format import parse, read_pinned
from ..errors import LayaAotError
from ..manifest import MANIFEST, Bundle, check_schema, is_sha256, unsafe_relpath
from ..padding import CHUNK_TOKENS

T = TypeVar("T")

# who decides a row whose top two options are within the artifact's tie margin (runtime/backend.py)
NEAR_TIE_MODES = ("call", "rows", "off")
# off: every answer is the artifact's, whose agreement with fp32 was measured against laya's own in the same dtype
DEFAULT_NEAR_TIES = "off"
# when the loader builds laya's eager module (`LoadConfig.eager_module`)
EAGER_MODULE_MODES = ("lazy", "background", "now")
PIN_ENV = "LAYA_AOT_BUNDLE_SHA256"


class LoadArgumentError(LayaAotError, ValueError):
    """A value `laya_aot.load` does not take (a mode, a kind, a pin, a count): the caller's mistake, named with the
    values it takes."""


class LoadArgumentTypeError(LayaAotError, TypeError):
    """An argument of `laya_aot.load` of a type it does not take, or given twice (beside `config=`)."""


def near_tie_mode(value: Any) -> str:
    """One of NEAR_TIE_MODES; True/False are "call"/"off" (the switch's first form: on or off)."""
    if value is True or value is False:
        return "call" if value else "off"
    if isinstance(value, str) and value in NEAR_TIE_MODES:
        return value
    raise LoadArgumentError("near_ties=%r is not a near-tie mode; use %s (or True/False)"
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
        """The caller's mistakes (not the bundle's) as a LoadArgumentError (a ValueError); the config with
        `near_ties` as its mode. `prefer` is checked against the kinds only when given (the kinds' registry imports
        torch)."""
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 0:
            raise LoadArgumentError("chunk_tokens=%r is not a token count; use a whole number >= 0 (0: no token budget)"
                             % (self.chunk_tokens,))
        if self.prefer is not None:
            from .. import kinds

            if self.prefer not in kinds.RUNTIME_ORDER:
                raise LoadArgumentError("prefer=%r is not an artifact kind; use one of %s"
                                 % (self.prefer, ", ".join(kinds.RUNTIME_ORDER)))
        pin = self.bundle_sha256
        if pin is not None and (not isinstance(pin, str) or not is_sha256(pin.strip().lower())):
            raise LoadArgumentError("bundle_sha256=%r is not a sha256 (64 hex digits); `laya-aot inspect BUNDLE` "
                                    "prints the bundle's" % (str(pin)[:80],))
        mode = near_tie_mode(self.near_ties)
        if self.eager_module not in EAGER_MODULE_MODES:
            raise LoadArgumentError("eager_module=%r is not one of %s"
                                    % (self.eager_module, ", ".join(EAGER_MODULE_MODES)))
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
        raise LoadArgumentTypeError("config=%r is not a laya_aot.LoadConfig" % (config,))
    defaults = LoadConfig()
    clash = sorted(k for k, v in given.items() if v != getattr(defaults, k))
    if clash:
        raise LoadArgumentTypeError("load() got config= and %s: pass them in the LoadConfig "
                                    "(dataclasses.replace(config, %s=...))" % (", ".join(clash), clash[0]))
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
    tokenizer_snapshot: Optional[str] = None  # where a first start's tokenizer snapshot came from (`TokenizerSeed`)
    ranking: Optional[str] = None             # whose latencies ranked the artifacts (`select.StartOrder.ranking`)
    start_costs_here_s: Optional[Dict[str, float]] = None  # the starts recorded here (`start_costs.known`)
    extra: Dict[str, Any] = field(default_factory=dict)    # a fall-back's eager module figures

    def as_dict(self) -> Dict[str, Any]:
        """The figures as a plain dict (what users read), those never set left out."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "extra" and getattr(self, f.name) is not None}
        out.update(self.extra)
        return out


class NoArtifactError(LayaAotError, RuntimeError):
    """strict=True and no artifact of the bundle can serve this agent; the message lists every reason."""


def reasons_of(rejected: List[Tuple[str, str]]) -> str:
    """Every reason of a load, one after another (for the warning or the error when nothing serves)."""
    return "; ".join("%s: %s" % (name, why) for name, why in rejected) or "the bundle lists no artifacts"


def no_artifact(strict: bool, bundle_name: Any, rejected: List[Tuple[str, str]], stacklevel: int) -> None:
    """No artifact of `bundle_name` serves (each of `rejected` says why): `strict` raises NoArtifactError,
    otherwise one warning says laya's eager forward serves."""
    if strict:
        raise NoArtifactError("laya-aot: no artifact of %s can serve this agent: %s"
                              % (bundle_name, reasons_of(rejected)))
    warnings.warn("laya-aot: using laya's eager forward; no artifact of %s fits: %s"
                  % (bundle_name, reasons_of(rejected)), RuntimeWarning, stacklevel=stacklevel + 1)


class LoadView(Protocol):
    """What the load's leaves read of it (`loader.LoadSession`): the head start and each candidate's checks take
    the load's facts, its values made once and its record of refusals from here, never the loader's steps."""

    ckpt: Path
    bundle: Optional[OpenedBundle]
    bundle_name: Any
    config: LoadConfig
    rejected: List[Tuple[str, str]]
    stats: LoadStats

    @property
    def pinned(self) -> bool: ...

    @property
    def manifest(self) -> Bundle: ...

    def order(self, agent: Any = None) -> Any: ...

    def mismatch(self) -> Optional[str]: ...
