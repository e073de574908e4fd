"""`bundle.json`: the versioned manifest that travels with a bundle, and the hashing both halves share.

The manifest is written last; the loader trusts nothing in a bundle that the manifest does not name
and hash. A reader refuses a schema newer than it knows (it could not tell what the new fields
mean) with an error that says to upgrade.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

SCHEMA = "laya-aot/bundle"
SCHEMA_VERSION = 1
MANIFEST = "bundle.json"
_CHUNK = 1 << 22


class BundleError(RuntimeError):
    """A bundle that cannot be used: missing, partial, tampered, foreign or from a newer laya-aot."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def sha256_tree(root: str | os.PathLike, file_digest: Callable[[Path], str] = sha256_file) -> str:
    """One digest for a directory: relative paths and file digests, sorted (a renamed file changes it)."""
    root = Path(root)
    h = hashlib.sha256()
    for p in sorted(x for x in root.rglob("*") if x.is_file()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + file_digest(p).encode() + b"\n")
    return h.hexdigest()


def write_json_atomic(path: str | os.PathLike, data: Dict[str, Any]) -> None:
    """Write JSON through a temporary file and rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(bundle: str | os.PathLike) -> Dict[str, Any]:
    """Read and check a bundle's manifest; raise BundleError naming the cause and the fix."""
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
    except (OSError, ValueError) as e:
        raise BundleError("%s is unreadable (%s); rebuild the bundle with `laya-aot build`" % (path, e)) from e
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise BundleError("%s is not a laya-aot manifest (schema %r); point bundle= at a directory written by "
                          "`laya-aot build`" % (path, data.get("schema") if isinstance(data, dict) else None))
    version = data.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise BundleError("%s uses manifest schema version %r, newer than this laya-aot understands (%d); "
                          "upgrade laya-aot or rebuild the bundle with this version"
                          % (path, version, SCHEMA_VERSION))
    if not isinstance(data.get("artifacts"), list):
        raise BundleError("%s lists no artifacts; rebuild the bundle with `laya-aot build`" % path)
    return data


def checkpoint_sha256(manifest: Dict[str, Any]) -> Optional[str]:
    """The fingerprint of the checkpoint a bundle was built from, as its manifest records it."""
    return (manifest.get("checkpoint") or {}).get("fingerprint", {}).get("sha256")


def built_from(bundle: str | os.PathLike, checkpoint: str | os.PathLike) -> bool:
    """Whether `bundle` is a readable bundle built from this very checkpoint (its fingerprint matches)."""
    from .checkpoint import fingerprint

    try:
        m = read_manifest(bundle)
    except BundleError:
        return False
    return checkpoint_sha256(m) == fingerprint(Path(checkpoint))["sha256"]


def artifact_path(bundle: str | os.PathLike, entry: Dict[str, Any]) -> Path:
    """The file an artifact entry names, refusing paths that escape the bundle."""
    bundle = Path(bundle).resolve()
    rel = str(entry.get("path", ""))
    p = (bundle / rel).resolve()
    if not rel or bundle not in p.parents:
        raise BundleError("artifact %r names a path outside the bundle (%r); the manifest was tampered with "
                          "or hand-edited: rebuild the bundle" % (entry.get("name"), rel))
    return p


def check_artifact_hash(bundle: str | os.PathLike, entry: Dict[str, Any]) -> Optional[str]:
    """None when the artifact's bytes match the manifest, else the reason (missing file, changed bytes)."""
    try:
        p = artifact_path(bundle, entry)
    except BundleError as e:
        return str(e)
    if not p.exists():
        return "file %s is missing; the bundle is incomplete: rebuild it" % entry.get("path")
    # digests are reused while a file's size, mtime, ctime and inode are unchanged (as for the checkpoint
    # fingerprint): re-hashing a 440 MB frozen package cost 0.75 s of every start on the CPU
    from .checkpoint import cached_sha256

    actual = sha256_tree(p, cached_sha256) if p.is_dir() else cached_sha256(p)
    if actual != entry.get("sha256"):
        return ("sha256 of %s is %s..., the manifest says %s...: the file was changed after the build; "
                "rebuild the bundle" % (entry.get("path"), actual[:12], str(entry.get("sha256"))[:12]))
    return None


def artifacts_by_kind(manifest: Dict[str, Any], kind: str) -> List[Dict[str, Any]]:
    return [a for a in manifest["artifacts"] if a.get("kind") == kind]
