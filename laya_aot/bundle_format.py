"""The bundle on disk: bundle.json's bytes (read, parsed, pinned, written), the files its artifacts list
(hashed, checked, resolved under the path rules), for the build, the loader and merge, pack, unpack, fetch.

`manifest` is the schema and the strict reader of what the bytes say; this module is everything that
touches the bytes and the disk. A bundle is its manifest plus, per built artifact, the files listed in
`Artifact.files` (schema 2: path, sha256, size); nothing else in a bundle directory travels. A schema-1
manifest lists no files: they are listed from the artifact's path and accepted only when they add up
to its sha256 (`files_of`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from .files import cached_sha256, sha256_file, sha256_tree, write_bytes_atomic
from .manifest import (
    MANIFEST,
    REBUILD,
    Artifact,
    Bundle,
    BundleError,
    FileRecord,
    Kinds,
    check_schema,
    files_digest,
    smoke_digest,
    text_digest,
    unsafe_relpath,
)

log = logging.getLogger(__name__)

# a build writes < 12 MiB: the smoke record < 4 MiB (64 x 4096 tokens), the tokenizer snapshot at most
# MAX_TOKENIZER_SNAPSHOT_BYTES (a larger one is not shipped)
MAX_MANIFEST_BYTES = 16 << 20
MAX_TOKENIZER_SNAPSHOT_BYTES = 8 << 20
# where a pin comes from, in the words of the message refusing a bundle that is not the pinned one (a server that
# reads its pins from another setting names that setting instead: laya_aot.serve)
PIN_SETTING = "bundle_sha256 or LAYA_AOT_BUNDLE_SHA256"


def bundle_sha256(bundle: str | os.PathLike) -> str:
    """The bundle's own hash: sha256 of its bundle.json bytes. The manifest lists every file's sha256
    (and the smoke record's), so this one value pins every byte a load can use."""
    return hashlib.sha256(_manifest_bytes(Path(bundle))).hexdigest()


def _manifest_bytes(bundle: Path) -> bytes:
    """bundle.json's bytes, read once: it must be a regular file in a directory (not a link to one elsewhere)."""
    path = bundle / MANIFEST
    try:
        is_dir = bundle.is_dir()
    except OSError:
        is_dir = False
    if not is_dir:
        raise BundleError("bundle %s does not exist or is not a directory; build one with "
                          "`laya-aot build checkpoint.path=DIR output_dir=%s`" % (bundle, bundle))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        partial = any(bundle.parent.glob(".%s.partial-*" % bundle.name))
        raise BundleError("%s has no %s: it is not a complete laya-aot bundle%s; rebuild it with `laya-aot build`"
                          % (bundle, MANIFEST, " (a build was interrupted)" if partial else "")) from None
    except OSError as e:
        raise BundleError("%s is unreadable (%s); check the bundle's permissions" % (path, e)) from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise BundleError("%s is %s, not a regular file: a bundle's files must be its own (no links); "
                          "copy the bundle with its files, or rebuild it with `laya-aot build`"
                          % (path, "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a file"))
    if st.st_size > MAX_MANIFEST_BYTES:
        raise BundleError("%s is %d bytes, more than a laya-aot manifest ever is (%d); %s"
                          % (path, st.st_size, MAX_MANIFEST_BYTES, REBUILD))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            return f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise BundleError("%s is unreadable (%s); check the bundle's permissions (a bundle is built readable "
                          "by everyone: 0644 files, 0755 directories)" % (path, e)) from None


def parse(raw: bytes, source: str, fix: str = "rebuild the bundle with `laya-aot build`") -> Any:
    """bundle.json's bytes as JSON: the one place they are parsed (a bundle directory, a pack's first member,
    the Hub). `source` names them in a message, `fix` ends the message about bytes that are not JSON."""
    if len(raw) > MAX_MANIFEST_BYTES:  # a directory and a pack refuse before reading; the Hub's file only here
        raise BundleError("%s is %d bytes, more than a laya-aot manifest ever is (%d); %s"
                          % (source, len(raw), MAX_MANIFEST_BYTES, REBUILD))
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise BundleError("%s nests too deeply to be a laya-aot manifest; %s" % (source, REBUILD)) from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise BundleError("%s is unreadable (%s); %s" % (source, str(e)[:200], fix)) from None


def parse_bundle(raw: bytes, kinds: Kinds, source: str, fix: str = "rebuild the bundle with `laya-aot build`"
                 ) -> Bundle:
    """bundle.json's bytes through the strict reader (`manifest.Bundle.from_dict`)."""
    return Bundle.from_dict(parse(raw, source, fix), kinds, source)


def read_manifest(bundle: str | os.PathLike) -> Dict[str, Any]:
    """The manifest as plain JSON, after the checks that need no schema (a regular file, parses, is ours)."""
    source = str(Path(bundle) / MANIFEST)
    data = parse(_manifest_bytes(Path(bundle)), source)
    check_schema(data, source)
    return data


def read_bundle(bundle: str | os.PathLike, kinds: Kinds, sha256: Optional[str] = None) -> Bundle:
    """Read and check a bundle's manifest; raise BundleError naming the field, the cause and the fix.

    `sha256` pins the bundle (`bundle_sha256`): the manifest's bytes must hash to it, checked on the very
    bytes that are then parsed (`read_pinned`)."""
    return parse_bundle(read_pinned(bundle, sha256), kinds, str(Path(bundle) / MANIFEST))


def read_pinned(bundle: str | os.PathLike, sha256: Optional[str] = None) -> bytes:
    """bundle.json's bytes (`_manifest_bytes`), which must hash to the pin `sha256` when one is given."""
    bundle = Path(bundle)
    raw = _manifest_bytes(bundle)
    if sha256 is not None:
        want = str(sha256).strip().lower()
        got = hashlib.sha256(raw).hexdigest()
        if got != want:
            raise BundleError("%s is not the pinned bundle: its sha256 is %s, the pin (%s) says %s; deploy the "
                              "bundle that was pinned, or pin this one after checking where it came from "
                              "(`laya-aot inspect %s` prints its sha256)"
                              % (bundle / MANIFEST, got, PIN_SETTING, want[:64], bundle))
    return raw


def encode(bundle: Bundle) -> bytes:
    """bundle.json's bytes for a manifest: what a build, merge and pack write (indented JSON, field order kept)."""
    return (json.dumps(bundle.to_dict(), indent=2) + "\n").encode("utf-8")


def write_manifest(directory: str | os.PathLike, bundle: Bundle) -> None:
    """Write bundle.json atomically (`files.write_bytes_atomic`), the smoke record's and the tokenizer snapshot's
    hashes filled in first."""
    if bundle.smoke is not None:
        bundle.smoke.sha256 = smoke_digest(bundle.smoke)
    if bundle.tokenizer_snapshot is not None:
        bundle.tokenizer_snapshot.sha256 = text_digest(bundle.tokenizer_snapshot.text)
    write_bytes_atomic(Path(directory) / MANIFEST, encode(bundle))


def record_files(root: str | os.PathLike, art: Artifact) -> None:
    """Hash every file of `art` under bundle directory `root`: its `files`, `sha256` and `size`."""
    p = Path(root) / str(art.path)
    found = [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())
    art.files = {f.relative_to(root).as_posix(): FileRecord(sha256_file(f), f.stat().st_size) for f in found}
    art.sha256 = files_digest(art)
    art.size = sum(r.size for r in art.files.values())


def bundle_file(bundle: str | os.PathLike, rel: str, what: str) -> Path:
    """`bundle/rel`, refusing a name that is absolute or has `..`, and any symbolic link on the way: a
    bundle's files are its own, so what is hashed is what is loaded, and nothing outside it is read."""
    why = unsafe_relpath(rel)
    if why:
        raise BundleError("%s names %r, %s; only paths inside the bundle are allowed: the manifest was damaged "
                          "or hand-edited: rebuild the bundle" % (what, rel, why))
    root = Path(bundle)
    p = root
    for part in [x for x in rel.split("/") if x not in ("", ".")]:
        p = p / part
        try:
            if stat.S_ISLNK(os.lstat(p).st_mode):
                raise BundleError("%s: %s is a symbolic link; a bundle's files must be its own (copy the files "
                                  "in, or rebuild the bundle)" % (what, p))
        except FileNotFoundError:
            break  # the caller reports a missing file
    return p


def artifact_path(bundle: str | os.PathLike, art: Artifact) -> Path:
    """The file or directory an artifact names, refusing paths that escape the bundle or pass a link."""
    if not art.path:
        raise BundleError("artifact %r names no path; the manifest was damaged or hand-edited: rebuild the bundle"
                          % art.name)
    return bundle_file(bundle, art.path, "artifact %r" % art.name)


def _links_in(root: Path) -> Optional[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                return p
    return None


def check_artifact_hash(bundle: str | os.PathLike, art: Artifact) -> Optional[str]:
    """None when the artifact's bytes match the manifest, else the reason (missing file, link, changed bytes)."""
    try:
        p = artifact_path(bundle, art)
        if not p.exists():
            return "file %s is missing; the bundle is incomplete: rebuild it" % art.path
        if p.is_dir():
            link = _links_in(p)
            if link is not None:
                return ("%s is a symbolic link; a bundle's files must be its own (copy the files in, or rebuild "
                        "the bundle)" % link)
            # digests are reused while a file's size, mtime, ctime and inode are unchanged (as for the checkpoint
            # fingerprint): re-hashing a 440 MB frozen package cost 0.75 s of every start on the CPU
            actual = sha256_tree(p, cached_sha256)
            if actual != art.sha256:  # a digest entry saves a hash, never refuses a file: each hashed now
                actual = sha256_tree(p, sha256_file)
        elif p.is_file():
            actual = cached_sha256(p, art.sha256)
        else:
            return "%s is not a regular file or directory; rebuild the bundle" % art.path
    except BundleError as e:
        return str(e)
    except OSError as e:
        return ("its files cannot be read here (%s: %s); a bundle must be readable by the service's user "
                "(laya-aot writes 0644 files and 0755 directories): fix the permissions or rebuild it"
                % (type(e).__name__, e))
    if actual != art.sha256:
        return ("sha256 of %s is %s..., the manifest says %s...: the file was changed after the build; "
                "rebuild the bundle" % (art.path, actual[:12], str(art.sha256)[:12]))
    return None


def files_of(bundle: Path, art: Artifact) -> Tuple[Dict[str, FileRecord], Optional[str]]:
    """The artifact's file records, and why they cannot be trusted (None: they can)."""
    if art.files:
        return dict(art.files), None
    probe = replace(art, files={})
    if not (bundle / str(art.path)).exists():
        return {}, "%s is missing" % art.path
    record_files(bundle, probe)  # schema 1: list them from disk; they must add up to the recorded digest
    if files_digest(probe) != art.sha256:
        return {}, "the files under %s do not match the manifest's sha256 (changed after the build)" % art.path
    return probe.files, None


def manifest_files(bundle: Bundle) -> Dict[str, FileRecord]:
    """Every file a manifest names (schema 2), by its path in the bundle."""
    out: Dict[str, FileRecord] = {}
    for a in bundle.artifacts:
        if a.built:
            out.update(a.files)
    return out


def check_files(root: Path, files: Dict[str, FileRecord], digest: Callable[..., str] = sha256_file,
                limit: int = 5) -> Optional[str]:
    """None when every listed file is a regular file (no link) of the recorded size and sha256, else why."""
    bad = []
    for rel, rec in sorted(files.items()):
        try:
            p = bundle_file(root, rel, "file %s" % rel)  # no link on the way, not only the last component
            st = os.lstat(p)
        except BundleError as e:
            bad.append(str(e).split(";")[0])
            continue
        except FileNotFoundError:
            bad.append("%s is missing" % rel)
            continue
        except OSError as e:
            bad.append("%s cannot be read (%s)" % (rel, e.strerror or e))
            continue
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:  # fetch links the Hub's cache in; packing reads it once
            log.info("%s has %d hard links: its bytes are hashed as they are read, wherever else it appears",
                     rel, st.st_nlink)
        if not stat.S_ISREG(st.st_mode):
            bad.append("%s is not a regular file" % rel)
        elif st.st_size != rec.size:
            bad.append("%s is %d bytes, the manifest says %d" % (rel, st.st_size, rec.size))
        else:
            got = digest(p, rec.sha256)
            if got != rec.sha256:
                bad.append("%s has sha256 %s..., the manifest says %s..." % (rel, got[:12], rec.sha256[:12]))
        if len(bad) >= limit:
            break
    return "; ".join(bad) or None
