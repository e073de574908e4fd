"""`bundle.json`: the versioned, typed manifest that travels with a bundle; one module for writer and reader.

The manifest is written last; the loader trusts nothing in a bundle that the manifest does not name
and hash. Reading is strict: an unknown schema version, a missing required field, a value of the
wrong type, an unknown artifact kind or status, or a duplicate artifact name is a `BundleError`
naming the field (`artifacts[2].needs.device`), never a KeyError deep in the loader and never a
wildcard ("no `needs`" does not mean "no requirement"). Fields a newer writer adds are ignored.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Collection, Dict, List, Optional

from .files import cached_sha256, sha256_file, sha256_tree, write_json_atomic
from .padding import Ranges
from .tolerance import Agreement, Tolerance

SCHEMA = "laya-aot/bundle"
# 2: per-artifact `files` (path, sha256, size of every file: what unpack and fetch check) and `build_machine`
# (merged bundles hold artifacts from several machines). Version 1 is still read: its artifacts inherit the
# bundle's build machine and list no files (merge and pack record them after re-checking the hash).
SCHEMA_VERSION = 2
MANIFEST = "bundle.json"

DEVICES = ("cpu", "cuda")
DTYPES = ("fp32", "bf16", "fp16")
# built: compiled, verification pending (never on disk); unverified: the build had no machine to verify it on
STATUSES = ("built", "verified", "unverified", "failed_verification", "build_failed")
_REBUILD = "the manifest was damaged or hand-edited: rebuild the bundle with `laya-aot build`"


class BundleError(RuntimeError):
    """A bundle that cannot be used: missing, partial, tampered, foreign or from a newer laya-aot."""


def _choices(*values: str) -> Dict[str, Any]:
    return {"choices": values}


@dataclass
class Needs:
    """What a machine must have to run an artifact; `mismatch` in `variant` compares it field by field."""

    device: str = field(metadata=_choices(*DEVICES))
    torch: Optional[str] = None
    cxx11_abi: Optional[bool] = None
    cpu_isa: Optional[str] = None
    gpu_arch: Optional[str] = None
    cuda: Optional[str] = None
    machine: Optional[str] = None
    os: Optional[str] = None


@dataclass
class VerifyResult:
    """One artifact against the eager fp32 forward: the figures, the rule applied and the verdict."""

    passed: bool
    reason: Optional[str] = None
    tolerance: Optional[float] = None
    argmax_required: Optional[float] = None
    max_abs_option_prob: Optional[float] = None
    max_abs_action_prob: Optional[float] = None
    argmax_agreement: Optional[float] = None
    rows_compared: Optional[int] = None
    cases: Dict[str, Any] = field(default_factory=dict)
    seconds: Optional[float] = None
    # the rule applied, in words, and (16-bit artifacts) laya's eager forward in the same dtype on the same cases
    rule: Optional[str] = None
    eager_in_dtype: Optional[Agreement] = None


@dataclass
class FileRecord:
    """One file of an artifact, as the build wrote it: what unpacking and fetching check each file against."""

    sha256: str
    size: int


@dataclass
class Artifact:
    """One artifact of a bundle: where it is, what it needs, what it is, and how it verified."""

    name: str
    kind: str
    status: str = field(metadata=_choices(*STATUSES))
    device: str = field(metadata=_choices(*DEVICES))
    needs: Needs
    path: Optional[str] = None
    variant: Optional[str] = None
    dtype: Optional[str] = field(default=None, metadata=_choices(*DTYPES))
    action_head_dtype: Optional[str] = field(default=None, metadata=_choices(*DTYPES))
    ranges: Optional[Ranges] = None
    sha256: Optional[str] = None
    size: Optional[int] = None
    build_seconds: Optional[float] = None
    details: Dict[str, Any] = field(default_factory=dict)
    verify: Optional[VerifyResult] = None
    latency_ms: Dict[str, Dict[str, float]] = field(default_factory=dict)
    error: Optional[str] = None
    # every file of the artifact by its path in the bundle (schema 2), and the machine that built it
    files: Dict[str, FileRecord] = field(default_factory=dict)
    build_machine: Dict[str, Any] = field(default_factory=dict)

    @property
    def built(self) -> bool:
        return self.status != "build_failed"


@dataclass
class Fingerprint:
    sha256: str
    files: Dict[str, str]


@dataclass
class CheckpointInfo:
    """The checkpoint a bundle was built from; its fingerprint decides whether a bundle fits a checkpoint."""

    name: str
    path: str
    max_len: int
    n_actions: int
    option_layout: str
    fingerprint: Fingerprint
    head_layers: Optional[int] = None
    # `amp_dtype` as rl_agent_config.json states it (None: absent, which laya serves as fp16 on CUDA)
    amp_dtype: Optional[str] = None


@dataclass
class SmokeRecord:
    """A seeded batch and the eager fp32 outputs on it: what the loader checks a loaded artifact against."""

    inputs: List[Any]
    input_dtypes: List[str]
    reference: List[Any]


@dataclass
class Bundle:
    """The whole manifest. `artifacts` holds every artifact the build attempted, failed ones included."""

    schema: str
    schema_version: int
    laya_aot_version: str
    created: str
    checkpoint: CheckpointInfo
    artifacts: List[Artifact]
    target: Dict[str, Any] = field(default_factory=dict)
    build_machine: Dict[str, Any] = field(default_factory=dict)
    tolerance: Tolerance = field(default_factory=Tolerance)
    ranges: Optional[Ranges] = None
    eager_latency_ms: Dict[str, Any] = field(default_factory=dict)
    smoke: Optional[SmokeRecord] = None
    stages: List[Dict[str, Any]] = field(default_factory=list)
    config: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def artifact(self, name: str) -> Artifact:
        for a in self.artifacts:
            if a.name == name:
                return a
        raise KeyError(name)

    def of_kind(self, kind: str) -> List[Artifact]:
        return [a for a in self.artifacts if a.kind == kind]

    @classmethod
    def from_dict(cls, data: Any, kinds: Collection[str], source: str = MANIFEST) -> "Bundle":
        """Check the envelope, then every field; `kinds` are the artifact kinds this laya-aot knows."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise BundleError("%s is not a laya-aot manifest (schema %r); point bundle= at a directory written by "
                              "`laya-aot build`" % (source, data.get("schema") if isinstance(data, dict) else None))
        version = data.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            _fail(source, "schema_version", "a schema version number (this laya-aot reads %d)" % SCHEMA_VERSION,
                  version)
        if version > SCHEMA_VERSION:
            raise BundleError("%s uses manifest schema version %r, newer than this laya-aot understands (%d); "
                              "upgrade laya-aot or rebuild the bundle with this version"
                              % (source, version, SCHEMA_VERSION))
        try:
            bundle = _read(cls, data, "", source)
        except RecursionError:
            raise BundleError("%s nests too deeply to be a laya-aot manifest; %s" % (source, _REBUILD)) from None
        seen = set()
        for i, a in enumerate(bundle.artifacts):
            _check_artifact(a, kinds, "artifacts[%d]" % i, source)
            if version >= 2:
                _check_files(a, "artifacts[%d]" % i, source)
            if not a.build_machine:  # schema 1 (or a build that recorded it once): the bundle's machine built it
                a.build_machine = dict(bundle.build_machine)
            if a.name in seen:
                raise BundleError("%s lists artifact %r twice (artifacts[%d].name); %s" % (source, a.name, i, _REBUILD))
            seen.add(a.name)
        return bundle


def read_artifact(data: Any, kinds: Collection[str], source: str) -> Artifact:
    """One artifact entry on its own (as a probe child receives it), checked like a manifest's."""
    try:
        art = _read(Artifact, data, "", source)
    except RecursionError:
        raise BundleError("%s nests too deeply to be an artifact entry; %s" % (source, _REBUILD)) from None
    _check_artifact(art, kinds, "", source)
    return art


def _check_artifact(a: Artifact, kinds: Collection[str], where: str, source: str) -> None:
    """What the field types cannot say: a known kind, and a built artifact's path, hash, ranges and dtype."""
    at = (where + ".") if where else ""
    if a.kind not in kinds:
        _fail(source, at + "kind", "one of %s" % ", ".join(sorted(kinds)), a.kind)
    if a.built:
        for name in ("path", "sha256", "ranges", "dtype"):
            if getattr(a, name) is None:
                _fail(source, at + name, "a value for a built artifact", None)


def _check_files(a: Artifact, where: str, source: str) -> None:
    """A built artifact lists its files, each inside its path, and they add up to its sha256 and size."""
    if not a.built:
        return
    if not a.files:
        _fail(source, where + ".files", "the artifact's files (schema 2 lists them)", a.files)
    for rel, rec in a.files.items():
        if not _inside(rel, str(a.path)) or rec.size < 0:
            _fail(source, "%s.files.%s" % (where, rel), "a file under %s with a size" % a.path, rel)
    if files_digest(a) != a.sha256:
        _fail(source, where + ".files", "files whose digests add up to sha256 %s" % a.sha256, "another digest")
    if a.size is not None and sum(r.size for r in a.files.values()) != a.size:
        _fail(source, where + ".size", "the sum of its files' sizes", a.size)


def _inside(rel: str, path: str) -> bool:
    parts = PurePosixPath(rel).parts
    return (not rel.startswith("/") and ".." not in parts and "." not in rel.split("/")
            and (rel == path or rel.startswith(path.rstrip("/") + "/")))


def files_digest(art: Artifact) -> str:
    """The artifact's sha256 from its file records, computed as the build computes it from the bytes
    (a file: its digest; a directory: `files.sha256_tree`)."""
    path = str(art.path)
    if list(art.files) == [path]:
        return art.files[path].sha256
    h = hashlib.sha256()
    for rel in sorted(art.files, key=lambda r: PurePosixPath(r).parts):
        inner = PurePosixPath(rel).relative_to(path).as_posix()
        h.update(inner.encode() + b"\0" + art.files[rel].sha256.encode() + b"\n")
    return h.hexdigest()


def record_files(root: str | os.PathLike, art: Artifact) -> None:
    """Hash every file of `art` under bundle directory `root`: its `files`, `sha256` and `size`."""
    p = Path(root) / str(art.path)
    found = [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())
    art.files = {f.relative_to(root).as_posix(): FileRecord(sha256_file(f), f.stat().st_size) for f in found}
    art.sha256 = files_digest(art)
    art.size = sum(r.size for r in art.files.values())


def _fail(source: str, where: str, expected: str, got: Any) -> None:
    shown = repr(got)
    raise BundleError("%s is invalid at %s: expected %s, got %s; %s"
                      % (source, where or "the top level", expected, shown[:80], _REBUILD))


def _read(tp: Any, value: Any, where: str, source: str) -> Any:
    """`value` as type `tp`, or a BundleError naming `where`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _read(args[0], value, where, source)
    if origin in (list, List):
        if not isinstance(value, list):
            _fail(source, where, "a list", value)
        (item,) = typing.get_args(tp)
        return [_read(item, v, "%s[%d]" % (where, i), source) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            _fail(source, where, "an object", value)
        _, item = typing.get_args(tp)
        return {str(k): _read(item, v, "%s.%s" % (where, k), source) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            _fail(source, where, "an object", value)
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            at = "%s.%s" % (where, f.name) if where else f.name
            if f.name not in value:
                required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                if required or f.metadata.get("required"):
                    _fail(source, at, "a value (the field is required)", None)
                continue
            got = _read(hints[f.name], value[f.name], at, source)
            choices = f.metadata.get("choices")
            if choices and got is not None and got not in choices:
                _fail(source, at, "one of %s" % ", ".join(choices), got)
            kwargs[f.name] = got
        return tp(**kwargs)
    if tp is bool:
        if not isinstance(value, bool):
            _fail(source, where, "true or false", value)
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            _fail(source, where, "an integer", value)
        return value
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            _fail(source, where, "a number", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(source, where, "a string", value)
        return value
    raise TypeError("no reader for %r" % (tp,))  # a field type this module does not handle: a bug here


def read_manifest(bundle: str | os.PathLike) -> Dict[str, Any]:
    """The manifest as plain JSON, after the checks that need no schema (exists, parses, is ours)."""
    bundle = Path(bundle)
    path = bundle / MANIFEST
    if not bundle.is_dir():
        raise BundleError("bundle %s does not exist or is not a directory; build one with "
                          "`laya-aot build checkpoint.path=DIR output_dir=%s`" % (bundle, bundle))
    if not path.is_file():
        partial = any(bundle.parent.glob(".%s.partial-*" % bundle.name))
        raise BundleError("%s has no %s: it is not a complete laya-aot bundle%s; rebuild it with `laya-aot build`"
                          % (bundle, MANIFEST, " (a build was interrupted)" if partial else ""))
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except RecursionError:
        raise BundleError("%s nests too deeply to be a laya-aot manifest; %s" % (path, _REBUILD)) from None
    except (OSError, ValueError) as e:
        raise BundleError("%s is unreadable (%s); rebuild the bundle with `laya-aot build`" % (path, e)) from e
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise BundleError("%s is not a laya-aot manifest (schema %r); point bundle= at a directory written by "
                          "`laya-aot build`" % (path, data.get("schema") if isinstance(data, dict) else None))
    return data


def read_bundle(bundle: str | os.PathLike, kinds: Collection[str]) -> Bundle:
    """Read and check a bundle's manifest; raise BundleError naming the field, the cause and the fix."""
    return Bundle.from_dict(read_manifest(bundle), kinds, str(Path(bundle) / MANIFEST))


def write_manifest(directory: str | os.PathLike, bundle: Bundle) -> None:
    write_json_atomic(Path(directory) / MANIFEST, bundle.to_dict())


def artifact_path(bundle: str | os.PathLike, art: Artifact) -> Path:
    """The file an artifact names, refusing paths that escape the bundle."""
    bundle = Path(bundle).resolve()
    rel = str(art.path or "")
    p = (bundle / rel).resolve()
    if not rel or bundle not in p.parents:
        raise BundleError("artifact %r names a path outside the bundle (%r); the manifest was tampered with "
                          "or hand-edited: rebuild the bundle" % (art.name, rel))
    return p


def check_artifact_hash(bundle: str | os.PathLike, art: Artifact) -> Optional[str]:
    """None when the artifact's bytes match the manifest, else the reason (missing file, changed bytes)."""
    try:
        p = artifact_path(bundle, art)
    except BundleError as e:
        return str(e)
    if not p.exists():
        return "file %s is missing; the bundle is incomplete: rebuild it" % art.path
    # digests are reused while a file's size, mtime, ctime and inode are unchanged (as for the checkpoint
    # fingerprint): re-hashing a 440 MB frozen package cost 0.75 s of every start on the CPU
    actual = sha256_tree(p, cached_sha256) if p.is_dir() else cached_sha256(p)
    if actual != art.sha256:
        return ("sha256 of %s is %s..., the manifest says %s...: the file was changed after the build; "
                "rebuild the bundle" % (art.path, actual[:12], str(art.sha256)[:12]))
    return None
