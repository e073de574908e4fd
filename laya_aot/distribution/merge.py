"""`laya-aot merge OUT BUNDLE...`: partial bundles of one checkpoint, built on different machines, joined.

Whatever must agree is checked and every conflict listed in one error: the checkpoint fingerprint, the
laya-aot version, tolerance, ranges and smoke batch (its fp32 reference within the fp32 tolerance),
portable programs (`Kind.interchangeable`, compared by what they were exported from, since they are not
byte-reproducible), artifact names (one name, one sha256) and file paths (one path, one content).
Every input file is re-hashed first, each artifact keeps its own build facts, and the output is
assembled beside OUT (`staging`), so a refusal or a crash leaves OUT as it was.
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from .. import kinds, staging
from ..bundle_format import check_files, files_of, read_bundle, write_manifest
from ..files import cached_sha256
from ..manifest import SCHEMA, SCHEMA_VERSION, Artifact, Bundle, BundleError, path_conflicts
from .fetch import packed

log = logging.getLogger(__name__)


def _portable_facts(a: Artifact) -> Tuple:
    p = a.precision  # how it computes: a faithful fp16 program and a laya-policy bf16 one are not the same program
    return (a.dtype, a.ranges, a.action_head_dtype, a.variant, a.needs.torch, p and (p.policy, p.gemm))


def _smoke_conflict(first: Bundle, other: Bundle) -> str:
    a, b = first.smoke, other.smoke
    if (a is None) != (b is None):
        return "one has a smoke record and the other has none"
    if a is None or b is None:
        return ""
    if a.inputs != b.inputs or a.input_dtypes != b.input_dtypes:
        return "the smoke batches differ (another verify.seed or export ranges)"
    bound = first.tolerance.fp32
    worst = max((abs(x - y) for ra, rb in zip(a.reference, b.reference) for row_a, row_b in zip(ra, rb)
                 for x, y in zip(row_a, row_b)), default=0.0)
    if worst > bound:
        return "the smoke references differ by %.3g (more than the fp32 tolerance %.3g)" % (worst, bound)
    return ""


def _top_level_conflicts(parts: List[Tuple[Path, Bundle]]) -> List[str]:
    (p0, b0), out = parts[0], []
    for p, b in parts[1:]:
        if b.checkpoint.fingerprint.sha256 != b0.checkpoint.fingerprint.sha256:
            out.append("%s was built from another checkpoint than %s (fingerprint %s... against %s...); merge "
                       "bundles of one checkpoint only" % (p, p0, b.checkpoint.fingerprint.sha256[:12],
                                                            b0.checkpoint.fingerprint.sha256[:12]))
        if b.laya_aot_version != b0.laya_aot_version:
            out.append("%s was built by laya-aot %s, %s by %s; build every part with one laya-aot version"
                       % (p, b.laya_aot_version, p0, b0.laya_aot_version))
        if b.tolerance != b0.tolerance:
            out.append("%s was verified with another tolerance than %s; build every part with the same verify.* "
                       "settings" % (p, p0))
        if b.ranges != b0.ranges:
            out.append("%s was exported with other ranges than %s (%s against %s); build every part with the same "
                       "export.* settings" % (p, p0, b.ranges, b0.ranges))
        smoke = _smoke_conflict(b0, b)
        if smoke:
            out.append("%s and %s: %s; build every part with the same export.* and verify.* settings"
                       % (p0, p, smoke))
    return out


def _join(parts: List[Tuple[Path, Bundle]]) -> Tuple[List[Tuple[Path, Artifact]], List[str]]:
    """The artifacts to keep, with the bundle each comes from, and every conflict between them."""
    kept: Dict[str, Tuple[Path, Artifact]] = {}
    conflicts: List[str] = []
    for path, b in parts:
        for a in b.artifacts:
            if a.name in kept:
                p0, a0 = kept[a.name]
                if not a.built:
                    continue  # a failed attempt never displaces what another part built
                if not a0.built:
                    kept[a.name] = (path, a)
                    continue
                if a.sha256 == a0.sha256:
                    continue
                if kinds.get(a.kind).interchangeable:
                    if _portable_facts(a) != _portable_facts(a0):
                        conflicts.append("%s: different programs in %s and %s (dtype, precision, ranges, action "
                                         "head or torch differ); build every part with the same export.* settings "
                                         "and torch"
                                         % (a.name, p0, path))
                    continue  # the same export made twice: the exporters are not byte-reproducible, keep the first
                conflicts.append("artifact %s is in %s and %s with different content (sha256 %s... and %s...); "
                                 "build each artifact in one part only (switch its stage off in the others)"
                                 % (a.name, p0, path, str(a0.sha256)[:12], str(a.sha256)[:12]))
                continue
            kept[a.name] = (path, a)
    return list(kept.values()), conflicts


def _merged(parts: List[Tuple[Path, Bundle]], arts: List[Artifact]) -> Bundle:
    b0 = parts[0][1]
    eager: Dict[str, object] = {}
    for _, b in parts:
        for device, figures in b.eager_latency_ms.items():
            eager.setdefault(device, figures)  # the first part that measured it on this kind of device
    return Bundle(
        schema=SCHEMA, schema_version=SCHEMA_VERSION, laya_aot_version=b0.laya_aot_version,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        checkpoint=b0.checkpoint, artifacts=arts,
        target={"name": "+".join(str(b.target.get("name")) for _, b in parts), "parts": [b.target for _, b in parts]},
        build_machine={}, tolerance=b0.tolerance, ranges=b0.ranges, eager_latency_ms=eager, smoke=b0.smoke,
        tokenizer_snapshot=next((b.tokenizer_snapshot for _, b in parts if b.tokenizer_snapshot), None),
        stages=[dict(s, part=i) for i, (_, b) in enumerate(parts) for s in b.stages],
        config={"merged_from": [{"bundle": str(p), "created": b.created, "config": b.config} for p, b in parts]})


def merge(out: str | os.PathLike, bundles: Sequence[str | os.PathLike], overwrite: bool = False) -> Bundle:
    """Join partial bundles of one checkpoint into `out` (`staging.may_replace` decides whether what is there
    may go); a BundleError lists every conflict."""
    if not bundles:
        raise BundleError("merge needs at least one bundle: laya-aot merge OUT BUNDLE [BUNDLE...]")
    out = Path(out)
    for b in bundles:
        if packed(Path(b)):  # what load(bundle=) takes, but merge re-hashes and copies a directory's files
            what = ("a pack; merge joins bundle directories: unpack it first (`laya-aot unpack %s DIR`), then merge DIR"
                    % b if Path(b).is_file() else "a directory of packs; merge joins bundle directories: unpack each "
                    "part first (`laya-aot unpack PACK DIR`), then merge those directories")
            raise BundleError("%s is %s" % (b, what))
    staging.may_replace(out, "merge", overwrite)
    parts = [(Path(b), read_bundle(b, kinds.BY_NAME)) for b in bundles]
    problems = ["%s in %s: its manifest entry is invalid (%s); rebuild that part" % (a.name, path, a.invalid)
                for path, b in parts for a in b.artifacts if a.invalid]
    problems += _top_level_conflicts(parts)
    chosen, conflicts = _join(parts)
    problems += conflicts
    arts: List[Artifact] = []
    for path, a in chosen:  # every file of every kept artifact, re-hashed against its manifest
        if not a.built:
            arts.append(a)
            continue
        files, why = files_of(path, a)
        why = why or check_files(path, files, cached_sha256)
        if why:
            problems.append("%s in %s: %s" % (a.name, path, why))
        arts.append(replace(a, files=files))
    problems += path_conflicts([a for a in arts if a.built])
    if problems:
        raise BundleError("cannot merge %d bundles into %s:\n  - %s" % (len(parts), out, "\n  - ".join(problems)))
    merged = _merged(parts, arts)
    with staging.staged(out) as tmp:
        for (path, _), a in zip(chosen, arts):
            for rel in a.files:
                dst = tmp / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path / rel, dst)
        again = check_files(tmp, {rel: rec for a in arts for rel, rec in a.files.items()}, cached_sha256)
        if again:  # an input changed while it was copied
            raise BundleError("an input changed during the merge: %s; run the merge again" % again)
        write_manifest(tmp, merged)
        read_bundle(tmp, kinds.BY_NAME)  # what was written reads back under the strict reader
    log.info("merged %d bundles into %s: %d artifacts", len(parts), out, len(arts))
    return merged


__all__ = ["merge"]
