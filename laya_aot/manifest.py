"""`bundle.json`'s schema and its strict reader: the typed, versioned manifest that travels with a bundle.

Reading is strict: an unknown schema version, a missing required field, a value of the wrong type,
an unknown artifact kind or status, or a duplicate artifact name is a `BundleError` naming the field
(`artifacts[2].needs.device`), never a KeyError deep in the loader and never a wildcard ("no `needs`"
does not mean "no requirement"). Fields a newer writer adds are ignored. This module never touches
the disk: reading and writing the file, hashing files and the path rules on disk are `bundle_format`.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Union

from .errors import LayaAotError
from .numerics.dtypes import NAMES as DTYPES
from .numerics.tolerance import Agreement, DecisionAgreement, Tolerance, tie_margin
from .padding import MAX_ROWS, TOKEN_MULTIPLE, Ranges, context_tokens

SCHEMA = "laya-aot/bundle"
# 2: per-artifact `files` (path, sha256, size of every file: what unpack and fetch check) and `build_machine`
# (merged bundles hold artifacts from several machines). Version 1 is still read: its artifacts inherit the
# bundle's build machine and list no files (merge and pack record them after re-checking the hash).
SCHEMA_VERSION = 2
MANIFEST = "bundle.json"
DEVICES = ("cpu", "cuda")
# built: compiled, verification pending (never on disk); unverified: the build had no machine to verify it on
STATUSES = ("built", "verified", "unverified", "failed_verification", "build_failed")
REBUILD = "the manifest was damaged or hand-edited: rebuild the bundle with `laya-aot build`"
_VERSION = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}(\.[0-9]{1,4})?([a-z0-9.+-]{0,40})")
_PART_BYTES = (1 << 20, 1 << 30)  # the part sizes `fingerprint.parts` may be recorded in
_GPU_ARCH = re.compile(r"sm_[0-9]{2,3}a?")
_PACKAGE = r"[A-Za-z0-9_.-]{1,40}==[A-Za-z0-9_.+-]{1,40}"
_PACKAGES = re.compile(r"%s( %s){0,7}" % (_PACKAGE, _PACKAGE))
_GPU_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._()/+-]{0,79}")
MAX_TOLERANCE = 1.0  # a difference of probabilities: a bound above 1 accepts anything
MAX_SECONDS = 1e7  # build, verify and latency figures (about 4 months)
# what the build ever writes, with room: a value beyond these is damage, and would cost memory or loop long
_MAX_EXTENT = {"rows": MAX_ROWS, "tokens": 1 << 20, "markers": 1 << 12}
_MAX_ACTIONS = 1 << 12  # checkpoint.n_actions: a decision head far wider than any laya trains
MAX_DEPTH = 32  # nesting of free-form values (details, config, stages); the build writes fewer than 10 levels
SMOKE_INPUTS = (("input_ids", "int64", 2), ("attention_mask", "int64", 2), ("marker_pos", "int64", 2),
                ("marker_mask", "bool", 2), ("qtype", "int64", 1))
_MAX_SMOKE_ROWS, _MAX_SMOKE_TOKENS, _MAX_SMOKE_MARKERS = 64, 4096, 512
QUESTION_TYPES = 3  # laya's choice, score and noul (laya.common.QTYPES); an embedding index beyond it crashes
# the artifact kinds a reader accepts: their names, or the kinds by name (`laya_aot.kinds.BY_NAME`), whose
# `check_details(details)` then checks what the kind keeps in `Artifact.details` (None: nothing to say)
Kinds = Union[Collection[str], Mapping[str, Any]]


class BundleError(LayaAotError, RuntimeError):
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
    # a precompiled function (the compile route) is bound to the exact build torch checks on load: torch's full
    # version, Python's, and on a GPU triton's major.minor and the GPU's name. None: not bound (older bundles)
    torch_build: Optional[str] = None
    python_build: Optional[str] = None
    triton: Optional[str] = None
    gpu_name: Optional[str] = None
    # and to the Python packages whose code it traced, with their versions ("none": not installed), as
    # `variant.traced_packages` spells them: laya==0.4.15 transformers==5.25.0 kernels==0.19.1
    traced_packages: Optional[str] = None


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
    # 16-bit artifacts: decisions on the seeded decision suite against fp32, beside laya eager's in the same dtype
    decisions: Optional[DecisionAgreement] = None

    def tie_margin(self) -> Optional[float]:
        """`tolerance.tie_margin` from these figures: the top-two option gap below which the runtime leaves a
        decision to laya's eager forward (None when the option figure is missing)."""
        if self.max_abs_option_prob is None:
            return None
        return tie_margin(Agreement(self.max_abs_option_prob, self.max_abs_action_prob or 0.0,
                                    self.argmax_agreement or 0.0), self.eager_in_dtype)


@dataclass
class FileRecord:
    """One file of an artifact, as the build wrote it: what unpacking and fetching check each file against."""

    sha256: str
    size: int


@dataclass
class ProbeVerdict:
    """The build's passing probe of a native artifact (`probe.verdict_key`): a start of a pinned bundle on a machine
    whose facts give the same key takes it instead of running a probe child (`probe.cached_verdict`); an unpinned
    one runs the child (the key's inputs are public)."""

    # sha256 of the entry's loaded fields, the build machine's facts, the device and the probe's version
    key: str
    # None: the child captured and replayed a CUDA graph; else why not ("not probed" where the kind has none)
    graphs: Optional[str] = "not probed"


@dataclass
class Precision:
    """How an artifact computes (`export.precision`, `precision.gemm_dtype`): its policy, the dtype of its matrix
    products and why; for a measured choice, the largest |input| and |output| of a product on the verify suite's
    cases in fp32 and the headroom fp16 had to leave."""

    policy: str = field(metadata=_choices("faithful", "laya"))
    gemm: str = field(metadata=_choices(*DTYPES))
    reason: str = ""
    max_abs_gemm_input: Optional[float] = None
    max_abs_gemm_output: Optional[float] = None
    fp16_headroom: Optional[float] = None

    def describe(self) -> str:
        if self.policy == "laya":
            return "laya's policy (%s products under autocast)" % self.gemm
        return "faithful: %s products, fp32 elsewhere" % self.gemm


@dataclass
class Artifact:
    """One artifact of a bundle: where it is, what it needs, what it is, and how it verified. `dtype` is the dtype
    of the agents it serves (what laya serves the checkpoint in); `precision`, how it computes (None: as laya serves
    in `dtype`, every artifact built before `export.precision`)."""

    name: str
    kind: str
    status: str = field(metadata=_choices(*STATUSES))
    device: str = field(metadata=_choices(*DEVICES))
    needs: Needs
    path: Optional[str] = None
    variant: Optional[str] = None
    dtype: Optional[str] = field(default=None, metadata=_choices(*DTYPES))
    action_head_dtype: Optional[str] = field(default=None, metadata=_choices(*DTYPES))
    precision: Optional[Precision] = None
    ranges: Optional[Ranges] = None
    sha256: Optional[str] = None
    size: Optional[int] = None
    build_seconds: Optional[float] = None
    details: Dict[str, Any] = field(default_factory=dict)
    verify: Optional[VerifyResult] = None
    latency_ms: Dict[str, Dict[str, float]] = field(default_factory=dict)
    # the 90th minus the 10th percentile of the same calls' times (absent in bundles built before it existed)
    latency_spread_ms: Dict[str, Dict[str, float]] = field(default_factory=dict)
    error: Optional[str] = None
    # every file of the artifact by its path in the bundle (schema 2), and the machine that built it
    files: Dict[str, FileRecord] = field(default_factory=dict)
    build_machine: Dict[str, Any] = field(default_factory=dict)
    # native kinds: the build's own probe of this entry passed on its machine (`ProbeVerdict`)
    probe_verdict: Optional[ProbeVerdict] = None
    # set by the reader, never written: why this entry's values are beyond what a build writes (an
    # impossible version, a non-finite tolerance, ...); `usable.reject_reason` rejects the artifact with it,
    # and the bundle's other artifacts are still considered
    invalid: Optional[str] = field(default=None, compare=False, metadata={"internal": True})

    @property
    def built(self) -> bool:
        return self.status != "build_failed"

    def to_dict(self) -> Dict[str, Any]:
        """The entry as the manifest holds it (what the probe child receives and its verdict is keyed by)."""
        return _public(dataclasses.asdict(self), type(self))


@dataclass
class Fingerprint:
    """The checkpoint's files by their sha256 and one combined digest (`checkpoint.fingerprint`); `parts`: the
    large files' `files.sha256_parts` in parts of `part_bytes`, which the loader checks instead of their sha256
    (absent from bundles built before laya-aot recorded it: their files are checked by sha256)."""

    sha256: str
    files: Dict[str, str]
    parts: Dict[str, str] = field(default_factory=dict)
    part_bytes: int = 0


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
    # sha256 of the three fields above (`smoke_digest`), filled in by `write_manifest`: a record that was
    # damaged or edited by hand is never run (None in a bundle written before the hash existed)
    sha256: Optional[str] = None


@dataclass
class TokenizerSnapshot:
    """laya's tokenizer as the build proved a snapshot of it (`tokenizer_snapshot.make`): a start on a machine
    whose cache lacks it reads this instead of importing transformers (`tokenizer_snapshot.seed`)."""

    # the snapshot's key: the tokenizer files' digests and the transformers, tokenizers and laya versions
    key: str
    # the snapshot, as the machine cache stores it (JSON text)
    text: str
    # sha256 of `text` (`text_digest`), filled in by `write_manifest`: a snapshot damaged or edited by hand is
    # never used
    sha256: Optional[str] = None


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
    tokenizer_snapshot: Optional[TokenizerSnapshot] = None
    stages: List[Dict[str, Any]] = field(default_factory=list)
    config: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["artifacts"] = [a.to_dict() for a in self.artifacts]
        return out

    def artifact(self, name: str) -> Artifact:
        for a in self.artifacts:
            if a.name == name:
                return a
        raise KeyError(name)

    def of_kind(self, kind: str) -> List[Artifact]:
        return [a for a in self.artifacts if a.kind == kind]

    @classmethod
    def from_dict(cls, data: Any, kinds: Kinds, source: str = MANIFEST) -> "Bundle":
        """Check the envelope, then every field; `kinds` are the artifact kinds this laya-aot knows (`Kinds`)."""
        check_schema(data, source)
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
            raise BundleError("%s nests too deeply to be a laya-aot manifest; %s" % (source, REBUILD)) from None
        for rel in bundle.checkpoint.fingerprint.files:  # read again in the checkpoint at load: stay inside it
            why = unsafe_relpath(rel)
            if why:
                _fail(source, "checkpoint.fingerprint.files", "file names inside the checkpoint (%s)" % why, rel)
        fp = bundle.checkpoint.fingerprint
        if fp.parts and not _PART_BYTES[0] <= fp.part_bytes <= _PART_BYTES[1]:
            _fail(source, "checkpoint.fingerprint.part_bytes", "a part size of %d to %d bytes" % _PART_BYTES,
                  fp.part_bytes)
        for rel, digest in fp.parts.items():
            if rel not in fp.files or not is_sha256(digest):
                _fail(source, "checkpoint.fingerprint.parts", "digests (64 hex digits) of files the fingerprint lists",
                      rel)
        _check_tolerance(bundle.tolerance, source)
        context = bundle.checkpoint.max_len
        if not 1 <= context <= _MAX_EXTENT["tokens"]:
            _fail(source, "checkpoint.max_len", "between 1 and %d" % _MAX_EXTENT["tokens"], context)
        if bundle.ranges is not None:
            _check_ranges(bundle.ranges, "ranges", source, context)
        if not 1 <= bundle.checkpoint.n_actions <= _MAX_ACTIONS:  # the smoke record's width follows it
            _fail(source, "checkpoint.n_actions", "between 1 and %d" % _MAX_ACTIONS,
                  bundle.checkpoint.n_actions)
        if bundle.smoke is not None:
            _check_smoke(bundle.smoke, bundle.checkpoint.n_actions, source)
        snap = bundle.tokenizer_snapshot
        if snap is not None and not is_sha256(snap.key):
            _fail(source, "tokenizer_snapshot.key", "a sha256 (64 hex digits)", snap.key)
        seen = set()
        for i, a in enumerate(bundle.artifacts):
            _check_artifact(a, kinds, "artifacts[%d]" % i, source, context)
            if version >= 2:
                _check_files(a, "artifacts[%d]" % i, source)
            if not a.build_machine:  # schema 1 (or a build that recorded it once): the bundle's machine built it
                a.build_machine = dict(bundle.build_machine)
            if a.name in seen:
                raise BundleError("%s lists artifact %r twice (artifacts[%d].name); %s" % (source, a.name, i, REBUILD))
            seen.add(a.name)
        conflicts = path_conflicts([a for a in bundle.artifacts if a.built])
        if conflicts:  # checked once for the whole bundle: no directory could hold these files
            raise BundleError("%s is invalid at artifacts[].files: %s; %s" % (source, conflicts[0], REBUILD))
        return bundle


def is_sha256(value: str) -> bool:
    """Whether `value` spells a sha256 as the manifest holds them: 64 lower-case hex digits."""
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def check_schema(data: Any, source: str) -> None:
    """Refuse JSON that is not a laya-aot manifest (the envelope's `schema`); the one place that decides it."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise BundleError("%s is not a laya-aot manifest (schema %r); point bundle= at a directory written by "
                          "`laya-aot build`" % (source, str(data.get("schema"))[:80] if isinstance(data, dict)
                                                else None))


def _public(d: Dict[str, Any], tp: Any) -> Dict[str, Any]:
    for f in dataclasses.fields(tp):
        if f.metadata.get("internal"):
            d.pop(f.name, None)
    return d


def read_artifact(data: Any, kinds: Kinds, source: str) -> Artifact:
    """One artifact entry on its own (as a probe child receives it), checked like a manifest's."""
    try:
        art = _read(Artifact, data, "", source)
    except RecursionError:
        raise BundleError("%s nests too deeply to be an artifact entry; %s" % (source, REBUILD)) from None
    _check_artifact(art, kinds, "", source)
    if art.invalid:
        raise BundleError("%s is invalid: %s; %s" % (source, art.invalid, REBUILD))
    return art


def _check_artifact(a: Artifact, kinds: Kinds, where: str, source: str,
                    context: Optional[int] = None) -> None:
    """What the field types cannot say: a known kind, and a built artifact's path, hash, ranges and dtype."""
    at = (where + ".") if where else ""
    if a.kind not in kinds:
        _fail(source, at + "kind", "one of %s" % ", ".join(sorted(kinds)), a.kind)
    if a.built:
        for name in ("path", "sha256", "ranges", "dtype"):
            if getattr(a, name) is None:
                _fail(source, at + name, "a value for a built artifact", None)
    if a.path is not None:
        why = unsafe_relpath(a.path)
        if why:
            _fail(source, at + "path", "a path inside the bundle (%s)" % why, a.path)
    if a.ranges is not None:
        _check_ranges(a.ranges, at + "ranges", source, context)
    if a.probe_verdict is not None and not is_sha256(a.probe_verdict.key):
        _fail(source, at + "probe_verdict.key", "a sha256 (64 hex digits)", a.probe_verdict.key)
    check_details: Optional[Callable[[Dict[str, Any]], Optional[str]]] = getattr(
        kinds.get(a.kind), "check_details", None) if isinstance(kinds, Mapping) else None
    problem = check_details(a.details) if check_details else None
    if problem:  # a kind's own layout of `details` (TileLang: kernel files inside the artifact's directory)
        raise BundleError("%s is invalid at %sdetails.%s; %s" % (source, at, problem, REBUILD))
    a.invalid = _value_problem(a, at)


def _value_problem(a: Artifact, at: str) -> Optional[str]:
    """Why an entry that is well typed holds values no build writes (None: it does not). Such an entry
    rejects only its own artifact (`Artifact.invalid`): a damaged or hand-edited field costs one artifact."""
    def bad(field_name: str, expected: str, got: Any) -> str:
        return "%s%s is %s, expected %s" % (at, field_name, repr(got)[:40], expected)

    for name, pattern, expected in (("torch", _VERSION, "a torch version such as 2.13.0"),
                                    ("cuda", _VERSION, "a CUDA version such as 12.8"),
                                    ("gpu_arch", _GPU_ARCH, "a GPU architecture such as sm_90"),
                                    ("torch_build", _VERSION, "a torch build such as 2.11.0+cu130"),
                                    ("python_build", _VERSION, "a Python version such as 3.11.7"),
                                    ("triton", _VERSION, "a triton version such as 3.5"),
                                    ("gpu_name", _GPU_NAME, "a GPU name such as NVIDIA H200"),
                                    ("traced_packages", _PACKAGES, "packages such as laya==0.4.15 kernels==none")):
        v = getattr(a.needs, name)
        if v is not None and not pattern.fullmatch(v):
            return bad("needs." + name, expected, v)

    def unit(v: Optional[float]) -> bool:
        return v is None or (math.isfinite(v) and 0.0 <= v <= 1.0)

    def seconds(v: Optional[float]) -> bool:
        return v is None or (math.isfinite(v) and 0.0 <= v <= MAX_SECONDS)

    v = a.verify
    if v is not None:
        if v.tolerance is not None and not (math.isfinite(v.tolerance) and 0.0 < v.tolerance <= MAX_TOLERANCE):
            return bad("verify.tolerance", "a finite number in (0, %g]" % MAX_TOLERANCE, v.tolerance)
        for name in ("argmax_required", "max_abs_option_prob", "max_abs_action_prob", "argmax_agreement"):
            if not unit(getattr(v, name)):
                return bad("verify." + name, "a finite number in [0, 1]", getattr(v, name))
        if v.eager_in_dtype is not None:
            for name in ("max_abs_option_prob", "max_abs_action_prob", "argmax_agreement"):
                if not unit(getattr(v.eager_in_dtype, name)):
                    return bad("verify.eager_in_dtype." + name, "a finite number in [0, 1]",
                               getattr(v.eager_in_dtype, name))
        if v.rows_compared is not None and not 0 <= v.rows_compared <= 1 << 24:
            return bad("verify.rows_compared", "a count of rows", v.rows_compared)
        if not seconds(v.seconds):
            return bad("verify.seconds", "a duration in seconds", v.seconds)
    p = a.precision
    if p is not None:
        for name in ("max_abs_gemm_input", "max_abs_gemm_output"):
            v = getattr(p, name)
            if v is not None and not (math.isfinite(v) and v >= 0.0):
                return bad("precision." + name, "a finite number >= 0", v)
        if p.fp16_headroom is not None and not (math.isfinite(p.fp16_headroom) and p.fp16_headroom >= 1.0):
            return bad("precision.fp16_headroom", "a finite factor >= 1", p.fp16_headroom)
    if not seconds(a.build_seconds):
        return bad("build_seconds", "a duration in seconds", a.build_seconds)
    if a.size is not None and a.size < 0:
        return bad("size", "a size in bytes", a.size)
    for name, table in (("latency_ms", a.latency_ms), ("latency_spread_ms", a.latency_spread_ms)):
        for device, figures in table.items():
            for shape, ms in figures.items():
                if not seconds(ms):
                    return bad("%s.%s.%s" % (name, device, shape), "milliseconds", ms)
    return None


def _check_tolerance(t: Tolerance, source: str) -> None:
    """The bundle's rule applies to every artifact: finite, and at most what a difference of probabilities can be."""
    for f in dataclasses.fields(t):
        v = getattr(t, f.name)
        hi = 100.0 if f.name == "relative" else 1.0
        if isinstance(v, float) and not (math.isfinite(v) and 0.0 <= v <= hi):
            _fail(source, "tolerance." + f.name, "a finite number in [0, %g]" % hi, v)


def _check_ranges(r: Ranges, where: str, source: str, context: Optional[int] = None) -> None:
    """Sane extents; within a bundle also no more tokens than the checkpoint's context rounded up to the token
    multiple (`padding.context_tokens`: laya sends no longer row, padded, and the build never exports one)."""
    for what, limit in _MAX_EXTENT.items():
        lo, hi = getattr(r, "min_" + what), getattr(r, "max_" + what)
        if not 1 <= lo <= hi <= limit:
            _fail(source, "%s.min_%s/max_%s" % (where, what, what), "1 <= min <= max <= %d" % limit, (lo, hi))
    if r.min_markers < 2:  # laya's head always has the two marker columns of a yes/no question
        _fail(source, where + ".min_markers", "at least 2", r.min_markers)
    # every kind takes tokens as TOKEN_MULTIPLE x Dim: a native program fed any other length may kill the process
    # (a manifest edited to min_tokens 15 made the warm-up call die of SIGFPE), so the ranges must say so
    if r.token_multiple != TOKEN_MULTIPLE:
        _fail(source, where + ".token_multiple", "%d (the export's token step)" % TOKEN_MULTIPLE, r.token_multiple)
    for what in ("min_tokens", "max_tokens"):
        if getattr(r, what) % r.token_multiple:
            _fail(source, "%s.%s" % (where, what), "a multiple of token_multiple (%d)" % r.token_multiple,
                  getattr(r, what))
    if context is not None and r.max_tokens > context_tokens(context):
        _fail(source, where + ".max_tokens", "at most %d, checkpoint.max_len (%d, the checkpoint's context) rounded up "
              "to token_multiple" % (context_tokens(context), context), r.max_tokens)


def _shape(value: Any, depth: int, leaf: Any, where: str, source: str) -> tuple:
    """The shape of a rectangular nested list whose leaves are `leaf` (a type or tuple of types)."""
    if depth == 0:
        ok = isinstance(value, leaf) and not (isinstance(value, bool) and bool not in (leaf if isinstance(leaf, tuple)
                                                                                        else (leaf,)))
        if not ok:
            _fail(source, where, "a %s" % getattr(leaf, "__name__", "number"), value)
        return ()
    if not isinstance(value, list) or not value:
        _fail(source, where, "a non-empty list", value)
    inner = [_shape(v, depth - 1, leaf, "%s[%d]" % (where, i), source) for i, v in enumerate(value)]
    if any(x != inner[0] for x in inner):
        _fail(source, where, "rows of one length", [len(v) if isinstance(v, list) else v for v in value][:8])
    return (len(value),) + inner[0]


def _check_smoke(rec: SmokeRecord, n_actions: int, source: str) -> None:
    """The smoke batch is fed to native code: dtypes, shapes and index ranges that need no model are checked
    here (token ids below the vocabulary, which needs the checkpoint, are checked by the loader)."""
    if len(rec.inputs) != len(SMOKE_INPUTS) or rec.input_dtypes != [d for _, d, _ in SMOKE_INPUTS]:
        _fail(source, "smoke.input_dtypes", "%d inputs typed %s" % (len(SMOKE_INPUTS),
                                                                   [d for _, d, _ in SMOKE_INPUTS]),
              rec.input_dtypes)
    shapes = {}
    for (name, dtype, dims), value in zip(SMOKE_INPUTS, rec.inputs):
        shapes[name] = _shape(value, dims, bool if dtype == "bool" else int, "smoke.inputs.%s" % name, source)
    n, t = shapes["input_ids"]
    k = shapes["marker_pos"][1]
    expected = {"attention_mask": (n, t), "marker_pos": (n, k), "marker_mask": (n, k), "qtype": (n,)}
    for name, want in expected.items():
        if shapes[name] != want:
            _fail(source, "smoke.inputs.%s" % name, "shape %s (input_ids is %dx%d)" % (want, n, t), shapes[name])
    if not (n <= _MAX_SMOKE_ROWS and t <= _MAX_SMOKE_TOKENS and 2 <= k <= min(t, _MAX_SMOKE_MARKERS)):
        _fail(source, "smoke.inputs", "at most %d rows, %d tokens and between 2 and the token count of markers"
              % (_MAX_SMOKE_ROWS, _MAX_SMOKE_TOKENS), (n, t, k))
    ids, att, mpos, _, qtype = rec.inputs
    if any(x < 0 for row in ids for x in row):
        _fail(source, "smoke.inputs.input_ids", "token ids >= 0", min(min(row) for row in ids))
    if any(x not in (0, 1) for row in att for x in row):
        _fail(source, "smoke.inputs.attention_mask", "0 or 1", sorted({x for row in att for x in row})[:4])
    if any(not 0 <= x < t for row in mpos for x in row):
        _fail(source, "smoke.inputs.marker_pos", "positions inside the %d tokens" % t,
              [x for row in mpos for x in row if not 0 <= x < t][:4])
    if any(not 0 <= x < QUESTION_TYPES for x in qtype):
        _fail(source, "smoke.inputs.qtype", "question types 0..%d" % (QUESTION_TYPES - 1), qtype[:8])
    if len(rec.reference) != 2:
        _fail(source, "smoke.reference", "two outputs (option logits, action logits)", len(rec.reference))
    for name, value, want in (("logits", rec.reference[0], (n, k)), ("act_logits", rec.reference[1], (n, n_actions))):
        got = _shape(value, 2, (int, float), "smoke.reference.%s" % name, source)
        if got != want:
            _fail(source, "smoke.reference.%s" % name, "shape %s" % (want,), got)
        if not all(math.isfinite(x) for row in value for x in row):
            _fail(source, "smoke.reference.%s" % name, "finite numbers", "NaN or infinity")


def text_digest(text: str) -> str:
    """sha256 of a text field's UTF-8 bytes (the tokenizer snapshot's)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def smoke_digest(rec: SmokeRecord) -> str:
    """sha256 of a smoke record's batch and reference, in a canonical JSON form."""
    blob = json.dumps([rec.inputs, rec.input_dtypes, rec.reference], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def unsafe_relpath(rel: Any) -> Optional[str]:
    """Why `rel` is not a plain relative path that stays below its base (None: it is)."""
    if not isinstance(rel, str) or not rel:
        return "an empty name"
    if "\0" in rel or "\\" in rel:
        return "a NUL byte or a backslash"
    if rel.startswith("/") or os.path.isabs(rel):
        return "an absolute path"
    if any(part == ".." for part in rel.split("/")):
        return "a '..' component"
    return None


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


def path_conflicts(artifacts: List[Artifact]) -> List[str]:
    """The bundle's file paths checked across artifacts, once: one path listed twice with different bytes, or a
    file of one artifact that another's path runs through as a directory (`onnx` and `onnx/model.onnx`),
    which no directory on disk can hold. Empty: none."""
    owner: Dict[str, tuple] = {}  # file path -> (artifact name, sha256)
    out = []
    for a in artifacts:
        for rel, rec in a.files.items():
            if rel in owner and owner[rel][1] != rec.sha256:
                out.append("file %s belongs to both %s and %s with different bytes; rename one artifact"
                           % (rel, owner[rel][0], a.name))
            owner.setdefault(rel, (a.name, rec.sha256))
    for rel, (name, _) in sorted(owner.items()):
        parts = rel.split("/")
        for i in range(1, len(parts)):
            above = "/".join(parts[:i])
            if above in owner:
                out.append("file %s of %s is a directory on the way to %s of %s; one bundle cannot hold both"
                           % (above, owner[above][0], rel, name))
                break
    return out


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


def _fail(source: str, where: str, expected: str, got: Any) -> None:
    shown = repr(got)
    raise BundleError("%s is invalid at %s: expected %s, got %s; %s"
                      % (source, where or "the top level", expected, shown[:80], REBUILD))


def _bounded(value: Any, where: str, source: str) -> None:
    """Refuse a free-form value nested deeper than MAX_DEPTH (it would overflow the stack of later readers)."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if depth > MAX_DEPTH:
            _fail(source, where, "at most %d levels of nesting" % MAX_DEPTH, "deeper")
        if isinstance(v, dict):
            todo.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            todo.extend((x, depth + 1) for x in v)


@functools.lru_cache(maxsize=None)
def _hints(tp: Any) -> Dict[str, Any]:
    """A dataclass's resolved field types, once per class (resolving them per entry cost seconds on a manifest
    of 100,000 files)."""
    return typing.get_type_hints(tp)


def _read(tp: Any, value: Any, where: str, source: str) -> Any:
    """`value` as type `tp`, or a BundleError naming `where`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        _bounded(value, where, source)
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
        hints = _hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.metadata.get("internal"):  # the reader's own finding, never taken from a file
                continue
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
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float (10**400): as unbounded as 1e400 reads
            return math.inf if value > 0 else -math.inf
    if tp is str:
        if not isinstance(value, str):
            _fail(source, where, "a string", value)
        return value
    raise TypeError("no reader for %r" % (tp,))  # a field type this module does not handle: a bug here
