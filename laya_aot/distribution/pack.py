"""`laya-aot pack BUNDLE FILE` and `laya-aot unpack FILE DIR`: a bundle as one zstd-compressed tar.

The manifest is the archive's first member, so a reader learns what a pack holds (and whether this
machine can use it) from its first few kilobytes. Members follow in sorted order with mtime 0, uid and
gid 0 and mode 0644: packing one bundle twice gives the same bytes. A schema-2 bundle's bundle.json
travels byte for byte (a pin on its sha256 still holds after unpacking); a schema-1 one is upgraded,
its file list recorded after its hashes were checked.

Unpacking trusts nothing in the archive but what its manifest names: the manifest is read with the
strict reader first; then each member must be a regular file listed there (no absolute path, no `..`,
no link, device or directory), of the listed size, and its sha256 is checked as it is written.
Everything goes to a directory beside DIR that is renamed into place at the end (`staging`), so a
refused or truncated archive leaves nothing behind.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
from pathlib import Path, PurePosixPath
from typing import IO, Dict, NamedTuple, Optional, Tuple

from .. import kinds, staging
from ..files import cached_sha256
from ..manifest import MANIFEST, SCHEMA_VERSION, Bundle, BundleError, FileRecord, read_bundle, unsafe_relpath
from .bundle_files import check_files, files_of, manifest_files, refuse_foreign

log = logging.getLogger(__name__)

SUFFIX = ".tar.zst"
LEVEL = 10  # zstd level: packs are written once in CI and read many times
_MAX_MANIFEST = 64 << 20
_CHUNK = 1 << 20


class PackInfo(NamedTuple):
    path: Path
    sha256: str
    size: int
    files: int


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o644, 0, 0, "", ""
    return info


def _manifest_for_pack(bundle: Path) -> Tuple[bytes, Bundle, Dict[str, FileRecord]]:
    """bundle.json's bytes as they travel, the manifest, and every file it names (checked on disk)."""
    manifest = read_bundle(bundle, kinds.NAMES)
    raw = (bundle / MANIFEST).read_bytes()
    problems = []
    upgraded = False
    for a in manifest.artifacts:
        if not a.built:
            continue
        files, why = files_of(bundle, a)
        if why:
            problems.append("%s: %s" % (a.name, why))
        upgraded |= not a.files
        a.files = files
    files = manifest_files(manifest)
    why = check_files(bundle, files, cached_sha256)
    if why:
        problems.append(why)
    if problems:
        raise BundleError("cannot pack %s: its files do not match its manifest (%s); rebuild the bundle"
                          % (bundle, "; ".join(problems)))
    if upgraded:
        manifest.schema_version = SCHEMA_VERSION
        raw = (json.dumps(manifest.to_dict(), indent=2) + "\n").encode("utf-8")
    return raw, manifest, files


def pack(bundle: str | os.PathLike, file: str | os.PathLike) -> PackInfo:
    """Write `bundle` (checked against its manifest) to `file` as a zstd tar, atomically."""
    import zstandard

    bundle, file = Path(bundle), Path(file)
    raw, _, files = _manifest_for_pack(bundle)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(".%s.partial-%d" % (file.name, os.getpid()))
    try:
        with open(tmp, "wb") as f:
            with zstandard.ZstdCompressor(level=LEVEL).stream_writer(f, closefd=False) as z:
                with tarfile.open(fileobj=z, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                    tar.addfile(_member(MANIFEST, len(raw)), io.BytesIO(raw))
                    for rel in sorted(files, key=lambda r: PurePosixPath(r).parts):
                        with open(bundle / rel, "rb") as src:
                            tar.addfile(_member(rel, files[rel].size), src)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    info = PackInfo(file, cached_sha256(file), file.stat().st_size, len(files))
    log.info("packed %s into %s: %d files, %d bytes", bundle, file, info.files, info.size)
    return info


def _open(file: Path):
    import zstandard

    try:
        f = open(file, "rb")
    except OSError as e:
        raise BundleError("cannot read pack %s (%s); check the path" % (file, e)) from None
    reader = zstandard.ZstdDecompressor().stream_reader(f, closefd=True)
    return tarfile.open(fileobj=reader, mode="r|")


def _damaged(file: Path, e: BaseException) -> BundleError:
    return BundleError("pack %s is truncated or damaged (%s: %s); copy or download it again, or re-create it "
                       "with `laya-aot pack`" % (file, type(e).__name__, e))


def _broken() -> tuple:
    """What a truncated or corrupted stream raises (a short zstd frame ends the tar early: tarfile.ReadError)."""
    import zstandard

    return (tarfile.TarError, EOFError, zstandard.ZstdError)


def _read_manifest_member(tar: tarfile.TarFile, file: Path) -> Tuple[bytes, Bundle]:
    first = tar.next()
    if first is None or first.name != MANIFEST or not first.isreg():
        raise BundleError("pack %s does not start with %s (its first member is %r): it was not written by "
                          "`laya-aot pack`" % (file, MANIFEST, first.name if first else None))
    if first.size > _MAX_MANIFEST:
        raise BundleError("pack %s: its %s is %d bytes, more than a manifest ever is; re-create the pack"
                          % (file, MANIFEST, first.size))
    raw = tar.extractfile(first).read()
    if len(raw) != first.size:
        raise EOFError("the archive ends inside %s" % MANIFEST)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise BundleError("pack %s: its %s is unreadable (%s); re-create the pack" % (file, MANIFEST, str(e)[:200])) \
            from None
    manifest = Bundle.from_dict(data, kinds.NAMES, "%s:%s" % (file, MANIFEST))
    if any(a.built and not a.files for a in manifest.artifacts):
        raise BundleError("pack %s: its manifest lists no files for its artifacts (schema %d); re-create the pack "
                          "with this laya-aot's `laya-aot pack`" % (file, manifest.schema_version))
    return raw, manifest


def read_pack_manifest(file: str | os.PathLike) -> Bundle:
    """The manifest of a pack, read from its first member only (the rest is not decompressed)."""
    file = Path(file)
    try:
        with _open(file) as tar:
            return _read_manifest_member(tar, file)[1]
    except BundleError:
        raise
    except _broken() as e:
        raise _damaged(file, e) from None


def _refuse(file: Path, member: tarfile.TarInfo, expected: Dict[str, FileRecord], seen: set) -> Optional[str]:
    name = member.name
    why = unsafe_relpath(name)
    if why:
        return "member %r is %s" % (name, why)
    if not member.isreg():
        kind = ("a symbolic link" if member.issym() else "a hard link" if member.islnk() else
                "a device" if member.isdev() else "a directory" if member.isdir() else "not a regular file")
        return "member %r is %s (a pack holds regular files only)" % (name, kind)
    norm = PurePosixPath(name).as_posix()
    if norm not in expected:
        return "member %r is not a file its manifest lists" % name
    if norm in seen:
        return "member %r appears twice" % name
    if member.size != expected[norm].size:
        return "member %r is %d bytes, its manifest says %d" % (name, member.size, expected[norm].size)
    return None


def _extract(src: IO[bytes], dst: Path, size: int) -> str:
    h = hashlib.sha256()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    left = size
    with os.fdopen(fd, "wb") as out:
        while left:
            block = src.read(min(_CHUNK, left))
            if not block:
                raise EOFError("the archive ends inside %s" % dst.name)
            h.update(block)
            out.write(block)
            left -= len(block)
    return h.hexdigest()


def unpack(file: str | os.PathLike, out: str | os.PathLike) -> Bundle:
    """Extract pack `file` into directory `out` (absent, empty, or a bundle it replaces); refuse anything the
    manifest does not name exactly, leaving nothing behind."""
    file, out = Path(file), Path(out)
    refuse_foreign(out, "unpack")
    if not file.is_file():
        raise BundleError("pack %s does not exist or is not a file; make one with `laya-aot pack BUNDLE FILE`"
                          % file)
    tmp = staging.new_staging(out)
    try:
        try:
            with _open(file) as tar:
                raw, manifest = _read_manifest_member(tar, file)
                expected = manifest_files(manifest)
                (tmp / MANIFEST).write_bytes(raw)
                seen: set = set()
                while True:  # tar.next(), not iteration: iterating starts again at the manifest
                    member = tar.next()
                    if member is None:
                        break
                    why = _refuse(file, member, expected, seen)
                    if why:
                        raise BundleError("pack %s refused: %s; nothing was unpacked" % (file, why))
                    rel = PurePosixPath(member.name).as_posix()
                    seen.add(rel)
                    digest = _extract(tar.extractfile(member), tmp / rel, member.size)
                    if digest != expected[rel].sha256:
                        raise BundleError("pack %s refused: %s has sha256 %s... after extraction, its manifest says "
                                          "%s...; nothing was unpacked" % (file, rel, digest[:12],
                                                                          expected[rel].sha256[:12]))
        except BundleError:
            raise
        except _broken() as e:
            raise _damaged(file, e) from None
        missing = sorted(set(expected) - seen)
        if missing:
            raise BundleError("pack %s lacks %d file(s) its manifest lists (%s); re-create the pack"
                              % (file, len(missing), ", ".join(missing[:3])))
        read_bundle(tmp, kinds.NAMES)  # the manifest, read back from disk under the strict reader
        staging.publish(tmp, out)
    except BaseException:
        staging.discard(tmp)
        raise
    log.info("unpacked %s into %s: %d files", file, out, len(expected))
    return manifest


__all__ = ["SUFFIX", "PackInfo", "pack", "read_pack_manifest", "unpack"]
