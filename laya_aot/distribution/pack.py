"""`laya-aot pack BUNDLE FILE` and `laya-aot unpack FILE DIR`: a bundle as one zstd-compressed tar.

The manifest is the first member, so a reader learns from a few kilobytes what a pack holds; members
are sorted with fixed metadata, so one bundle packs to the same bytes. Unpacking trusts only what the
manifest names: regular files listed there, at their size and sha256, written to a staging directory
renamed into place at the end. The tar stream is read here rather than by tarfile, which reads a pax
record or long name whole: every header is bounded (`MAX_*`) first, so a hostile archive is refused
quickly in bounded memory.
"""
from __future__ import annotations

import hashlib
import io
import logging
import math
import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath
from typing import IO, Dict, Mapping, NamedTuple, Optional, Tuple

from .. import kinds, progress, staging
from ..bundle_format import (
    MAX_MANIFEST_BYTES,
    bundle_file,
    check_files,
    encode,
    files_of,
    manifest_files,
    parse,
    read_bundle,
)
from ..files import cached_sha256
from ..manifest import MANIFEST, SCHEMA_VERSION, Bundle, BundleError, FileRecord, unsafe_relpath
from . import PACK_SUFFIX

log = logging.getLogger(__name__)

LEVEL = 10  # zstd level: packs are written once in CI and read many times
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
    manifest = read_bundle(bundle, kinds.BY_NAME)
    raw = (bundle / MANIFEST).read_bytes()
    problems = []
    upgraded = False
    for a in manifest.artifacts:
        if a.invalid:
            problems.append("%s: its manifest entry is invalid (%s)" % (a.name, a.invalid))
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
        raw = encode(manifest)
    return raw, manifest, files


class _Hashing:
    """A file object that hashes what is read from it: the bytes packed are the bytes checked."""

    def __init__(self, f: IO[bytes]):
        self.f, self.sha = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        block = self.f.read(n)
        self.sha.update(block)
        return block


def _not_a_pack(file: Path) -> Optional[str]:
    """Why `file` is not a pack (None: `laya-aot pack` wrote it, and replacing it loses nothing)."""
    try:
        read_pack_manifest(file)
    except BundleError as e:
        return str(e).split(";")[0]
    return None


def pack(bundle: str | os.PathLike, file: str | os.PathLike, overwrite: bool = False) -> PackInfo:
    """Write `bundle` (checked against its manifest) to `file` as a zstd tar, atomically. `file` is never
    inside the bundle and never a directory; an existing file that is not a pack needs `overwrite`."""
    import zstandard

    bundle, file = Path(bundle), Path(file)
    if Path(os.path.realpath(file)).is_relative_to(os.path.realpath(bundle)):
        raise BundleError("cannot pack %s into %s: the pack would be written inside the bundle it packs; write it "
                          "outside, for example %s%s" % (bundle, file, bundle.resolve().parent / bundle.name,
                                                         PACK_SUFFIX))
    staging.may_replace(file, "pack", overwrite, ours=_not_a_pack, directory=False, noun="pack")
    if not file.name.endswith(PACK_SUFFIX):
        raise BundleError("cannot pack %s into %s: a pack's name ends in %s (what `laya-aot fetch`, `laya_aot.load` "
                          "and `laya-aot serve` know a pack by); pass %s%s" % (bundle, file, PACK_SUFFIX, file,
                                                                             PACK_SUFFIX))
    raw, _, files = _manifest_for_pack(bundle)
    file.parent.mkdir(parents=True, exist_ok=True)
    with staging.staged_file(file) as tmp, open(tmp, "wb") as f, \
            progress.task("pack %s" % bundle, total=sum(r.size for r in files.values()), unit="bytes") as line:
        with zstandard.ZstdCompressor(level=LEVEL).stream_writer(f, closefd=False) as z:
            with tarfile.open(fileobj=z, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                tar.addfile(_member(MANIFEST, len(raw)), io.BytesIO(raw))
                for rel in sorted(files, key=lambda r: PurePosixPath(r).parts):
                    fd = os.open(bundle_file(bundle, rel, "file %s" % rel),
                                 os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                    with os.fdopen(fd, "rb") as src:
                        hashing = _Hashing(src)
                        tar.addfile(_member(rel, files[rel].size), hashing)
                    line.advance(files[rel].size)
                    if hashing.sha.hexdigest() != files[rel].sha256:  # changed since it was checked
                        raise BundleError("cannot pack %s: %s changed while it was packed; pack it again"
                                          % (bundle, rel))
        f.flush()
        os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
    info = PackInfo(file, cached_sha256(file), file.stat().st_size, len(files))
    log.info("packed %s into %s: %d files, %d bytes", bundle, file, info.files, info.size)
    return info


# Limits on what a pack may declare, checked on each 512-byte header before anything it declares is read
# (tarfile would read a pax record or a GNU long name whole, whatever its size): a refusal costs the bytes
# read so far, and memory stays bounded whatever the archive says.
MAX_PAX_BYTES = 64 << 10  # one pax extended header (`laya-aot pack` writes a path and a size: < 1 KiB)
MAX_NAME_BYTES = 4096  # a member's name, from a pax `path` or a GNU long name (PATH_MAX)
MAX_MEMBERS = 100_000  # files a pack's manifest may list; headers read are bounded by 4 per listed file + 4
MAX_UNPACKED_BYTES = 1 << 40  # the sum of the manifest's file sizes (1 TiB), also checked against free space
MAX_ZSTD_WINDOW = 1 << 27  # zstd's default limit (128 MiB), stated: a frame asking for more is refused
# What unpacking may write per byte of pack. A manifest declaring more (2.9 MB of zeros declaring 4 GiB) is refused
# before anything is written; every member is then written at exactly its declared size, so the bytes written never
# exceed the declared total. Bundles compress about 1.1-4x (weights barely, programs 3-4x); ENV_MAX_RATIO raises it
# for a pack that honestly compresses better.
MAX_RATIO = 64
MIN_UNPACK_BYTES = 64 << 20  # what any pack may declare, however small (a bundle of a few text files compresses 10x+)
ENV_MAX_RATIO = "LAYA_AOT_UNPACK_MAX_RATIO"
_BLOCK = 512
_EXTENSIONS_PER_MEMBER = 3  # pax `x`, GNU `L`/`K` headers before one member; more is not an archive we wrote
_KIND = {b"1": "a hard link", b"2": "a symbolic link", b"3": "a device", b"4": "a device", b"5": "a directory",
         b"6": "a FIFO"}


class _Member(NamedTuple):
    name: str
    size: int
    type: bytes

    def isreg(self) -> bool:
        return self.type in (b"0", b"\0")


class _TarStream:
    """A ustar/pax reader over a stream that bounds every header before reading what it declares."""

    def __init__(self, stream: IO[bytes], file: Path, max_headers: int, pack_bytes: int = 0):
        self.f, self.file, self.max_headers, self.pack_bytes = stream, file, max_headers, pack_bytes
        self.headers = 0
        self._left = 0  # bytes of the current member's data not yet read, then its padding
        self._pad = 0

    def _refuse(self, why: str) -> BundleError:
        return BundleError("pack %s refused: %s; nothing was unpacked" % (self.file, why))

    def _exact(self, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            block = self.f.read(min(_CHUNK, n - got))
            if not block:
                raise EOFError("the archive ends after %d of %d bytes" % (got, n))
            parts.append(block)
            got += len(block)
        return b"".join(parts)

    def _skip(self, n: int) -> None:
        while n:
            n -= len(self._exact(min(_CHUNK, n)))

    def read(self, n: int) -> bytes:
        """Up to `n` bytes of the current member's data (b"" at its end)."""
        n = min(n, self._left)
        if not n:
            return b""
        block = self._exact(n)
        self._left -= len(block)
        return block

    def _number(self, field: bytes, what: str) -> int:
        if field[:1] and field[0] & 0x80:  # base-256 (GNU): big sizes
            value = int.from_bytes(field[1:], "big")
            if field[0] & 0x40:
                raise self._refuse("a negative %s" % what)
            return value
        text = field.split(b"\0", 1)[0].strip(b" ")
        try:
            return int(text or b"0", 8)
        except ValueError:
            raise self._refuse("a header whose %s is not a number" % what) from None

    def _data(self, size: int, limit: int, what: str) -> bytes:
        if size > limit:
            raise self._refuse("a %s of %d bytes (at most %d are read)" % (what, size, limit))
        data = self._exact(size)
        self._skip(-size % _BLOCK)
        return data

    def _pax(self, data: bytes) -> Dict[str, str]:
        out, pos = {}, 0
        while pos < len(data):
            sp = data.find(b" ", pos)
            try:
                length = int(data[pos:sp]) if sp > pos else 0
            except ValueError:
                length = 0
            record = data[pos:pos + length]
            if length <= sp - pos or pos + length > len(data) or not record.endswith(b"\n") or b"=" not in record:
                raise self._refuse("a malformed pax header")
            key, _, value = record[sp - pos + 1:-1].partition(b"=")
            out[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
            pos += length
        return out

    def next(self) -> Optional[_Member]:
        """The next member's header (its data then readable with `read`), or None at the archive's end."""
        self._skip(self._left + self._pad)
        self._left = self._pad = 0
        name: Optional[str] = None
        size: Optional[int] = None
        extensions = 0
        while True:
            block = self.f.read(_BLOCK)
            while block and len(block) < _BLOCK:
                more = self.f.read(_BLOCK - len(block))
                if not more:
                    break
                block += more
            if not block or block == bytes(_BLOCK):
                return None  # the end-of-archive marker (or the stream's end: missing files are found after)
            if len(block) < _BLOCK:
                raise EOFError("the archive ends inside a header")
            self.headers += 1
            if self.headers > self.max_headers:
                raise self._refuse("more than %d headers (%d per file its manifest lists)"
                                   % (self.max_headers, _EXTENSIONS_PER_MEMBER + 1))
            stored = self._number(block[148:156], "checksum")
            if stored != sum(block[:148]) + 256 + sum(block[156:]):
                raise self._refuse("a header whose checksum does not match (not a tar, or damaged)")
            kind = block[156:157]
            declared = self._number(block[124:136], "size")
            if kind in (b"x", b"g", b"L", b"K"):
                extensions += 1
                if extensions > _EXTENSIONS_PER_MEMBER:
                    raise self._refuse("more than %d extension headers before one member" % _EXTENSIONS_PER_MEMBER)
                if kind in (b"x", b"g"):
                    records = self._pax(self._data(declared, MAX_PAX_BYTES, "pax header"))
                    if kind == b"x":
                        if "path" in records:
                            name = records["path"]
                        if "size" in records:
                            try:
                                size = int(records["size"])
                            except ValueError:
                                raise self._refuse("a pax size that is not a number") from None
                else:
                    long = self._data(declared, MAX_NAME_BYTES, "GNU long name")
                    if kind == b"L":
                        name = long.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                continue
            if name is None:
                base = block[0:100].split(b"\0", 1)[0]
                posix = block[257:263] == b"ustar\0"  # a GNU header keeps times where POSIX keeps the prefix
                prefix = block[345:500].split(b"\0", 1)[0] if posix else b""
                name = ((prefix + b"/" if prefix else b"") + base).decode("utf-8", "surrogateescape")
            if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
                raise self._refuse("a member name of more than %d bytes" % MAX_NAME_BYTES)
            size = declared if size is None else size
            if size < 0:
                raise self._refuse("a negative size")
            member = _Member(name, size if kind in (b"0", b"\0", b"7") else 0, kind)
            self._left, self._pad = member.size, -member.size % _BLOCK
            return member


def _open(file: Path, max_headers: int = 4 * MAX_MEMBERS + 4):
    import zstandard

    try:
        f = open(file, "rb")
    except OSError as e:
        raise BundleError("cannot read pack %s (%s); check the path" % (file, e.strerror or e)) from None
    try:
        size = os.fstat(f.fileno()).st_size
    except OSError:
        f.close()
        raise
    reader = zstandard.ZstdDecompressor(max_window_size=MAX_ZSTD_WINDOW).stream_reader(f, closefd=True)
    return reader, _TarStream(reader, file, max_headers, size)


def max_ratio(env: Optional[Mapping[str, str]] = None) -> float:
    """The bytes unpacking may write per byte of pack: ENV_MAX_RATIO where set, else MAX_RATIO (`laya-aot serve`
    checks it as it starts)."""
    raw = (os.environ if env is None else env).get(ENV_MAX_RATIO, "").strip()
    if not raw:
        return float(MAX_RATIO)
    try:
        ratio = float(raw)
    except ValueError:
        ratio = math.nan
    if not (math.isfinite(ratio) and ratio >= 1):
        raise BundleError("invalid %s=%r: use a number >= 1, the bytes unpacking may write per byte of pack "
                          "(unset: %d)" % (ENV_MAX_RATIO, raw[:40], MAX_RATIO))
    return ratio


def unpack_limit(pack_bytes: int) -> int:
    """The most bytes a pack of `pack_bytes` may declare unpacked: `max_ratio()` times its size, at least
    MIN_UNPACK_BYTES."""
    return max(MIN_UNPACK_BYTES, int(max_ratio() * pack_bytes))


def _damaged(file: Path, e: BaseException) -> BundleError:
    return BundleError("pack %s is truncated or damaged (%s: %s); copy or download it again, or re-create it "
                       "with `laya-aot pack`" % (file, type(e).__name__, str(e)[:200]))


def _broken() -> tuple:
    """What a truncated or corrupted stream raises."""
    import zstandard

    return (EOFError, zstandard.ZstdError)


def _read_manifest_member(tar: _TarStream, file: Path) -> Tuple[bytes, Bundle]:
    first = tar.next()
    if first is None or first.name != MANIFEST or not first.isreg():
        raise BundleError("pack %s does not start with %s (its first member is %r): it was not written by "
                          "`laya-aot pack`" % (file, MANIFEST, first.name[:200] if first else None))
    if first.size > MAX_MANIFEST_BYTES:
        raise BundleError("pack %s: its %s is %d bytes, more than a manifest ever is (%d); re-create the pack"
                          % (file, MANIFEST, first.size, MAX_MANIFEST_BYTES))
    raw = tar.read(first.size)
    source = "%s:%s" % (file, MANIFEST)
    data = parse(raw, source, "re-create the pack")
    listed = sum(len(a.get("files") or ()) for a in data.get("artifacts") or () if isinstance(a, dict)) \
        if isinstance(data, dict) and isinstance(data.get("artifacts"), list) else 0
    if listed > MAX_MEMBERS:  # before the typed reader spends seconds on them
        raise BundleError("pack %s: its manifest lists %d files, more than a pack may hold (%d); re-create the pack"
                          % (file, listed, MAX_MEMBERS))
    manifest = Bundle.from_dict(data, kinds.BY_NAME, source)
    if any(a.built and not a.files for a in manifest.artifacts):
        raise BundleError("pack %s: its manifest lists no files for its artifacts (schema %d); re-create the pack "
                          "with this laya-aot's `laya-aot pack`" % (file, manifest.schema_version))
    files = manifest_files(manifest)
    total = sum(r.size for r in files.values())
    if len(files) > MAX_MEMBERS or total > MAX_UNPACKED_BYTES:
        raise BundleError("pack %s: its manifest lists %d files of %d bytes in all, more than a pack may hold (%d "
                          "files, %d bytes); re-create the pack" % (file, len(files), total, MAX_MEMBERS,
                                                                   MAX_UNPACKED_BYTES))
    limit = unpack_limit(tar.pack_bytes)
    if total > limit:  # a zip bomb, or a damaged manifest: refused before a byte is written
        raise BundleError("pack %s refused: its manifest declares %d bytes unpacked from a %d-byte pack, more than "
                          "the %d allowed (%g bytes per byte of pack, at least %d); nothing was unpacked: re-create "
                          "the pack with `laya-aot pack`, or set %s higher if this bundle honestly compresses that "
                          "well" % (file, total, tar.pack_bytes, limit, max_ratio(), MIN_UNPACK_BYTES, ENV_MAX_RATIO))
    tar.max_headers = min(tar.max_headers, (_EXTENSIONS_PER_MEMBER + 1) * (len(files) + 1))
    return raw, manifest


def read_pack_manifest(file: str | os.PathLike) -> Bundle:
    """The manifest of a pack, read from its first member only (the rest is not decompressed)."""
    return read_pack_manifest_bytes(file)[1]


def read_pack_manifest_bytes(file: str | os.PathLike) -> Tuple[bytes, Bundle]:
    """`read_pack_manifest`, with the manifest's bytes (what `fetch` compares a pack's cached unpacking with)."""
    file = Path(file)
    try:
        reader, tar = _open(file)
        with reader:
            return _read_manifest_member(tar, file)
    except BundleError:
        raise
    except _broken() as e:
        raise _damaged(file, e) from None
    except OSError as e:
        raise BundleError("cannot read pack %s (%s); check the path and its permissions" % (file, e.strerror or e)) \
            from None


def _refuse(member: _Member, expected: Dict[str, FileRecord], seen: set) -> Optional[str]:
    name = member.name
    why = unsafe_relpath(name)
    if why:
        return "member %r is %s" % (name[:200], why)
    if not member.isreg():
        kind = _KIND.get(member.type, "not a regular file")
        return "member %r is %s (a pack holds regular files only)" % (name[:200], kind)
    norm = PurePosixPath(name).as_posix()
    if norm not in expected:
        return "member %r is not a file its manifest lists" % name[:200]
    if norm in seen:
        return "member %r appears twice" % name
    if member.size != expected[norm].size:
        return "member %r is %d bytes, its manifest says %d" % (name, member.size, expected[norm].size)
    return None


def _extract(src: _TarStream, dst: Path, size: int) -> str:
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


def unpack(file: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False, *, cache: bool = False) -> Bundle:
    """Extract pack `file` into directory `out` (absent, empty, or a bundle it replaces: `staging.may_replace`;
    `cache`: `out` is laya-aot's cache entry for the pack, replaced whatever it holds); refuse anything the
    manifest does not name exactly, leaving nothing behind. Every header is bounded before what it declares is
    read (MAX_* above), so a hostile archive costs seconds and little memory."""
    file, out = Path(file), Path(out)
    staging.may_replace(out, "unpack", overwrite, cache=cache)
    if not file.is_file():
        raise BundleError("pack %s does not exist or is not a file; make one with `laya-aot pack BUNDLE FILE.tar.zst`"
                          % file)

    def unwritable(e: OSError) -> BundleError:
        return staging.OutputUnwritable("cannot write %s (%s); choose a directory you can write to"
                                        % (out, e.strerror or e), e)

    with staging.staged(out, unwritable) as tmp:
        try:
            manifest, expected, seen = _extract_all(file, tmp, out)
        except BundleError:
            raise
        except _broken() as e:
            raise _damaged(file, e) from None
        except OSError as e:
            raise BundleError("cannot unpack %s into %s (%s); check the space and permissions there"
                              % (file, out, e.strerror or e)) from None
        missing = sorted(set(expected) - seen)
        if missing:
            raise BundleError("pack %s lacks %d file(s) its manifest lists (%s); re-create the pack"
                              % (file, len(missing), ", ".join(missing[:3])))
        read_bundle(tmp, kinds.BY_NAME)  # the manifest, read back from disk under the strict reader
    log.info("unpacked %s into %s: %d files", file, out, len(expected))
    return manifest


def _extract_all(file: Path, tmp: Path, out: Path) -> Tuple[Bundle, Dict[str, FileRecord], set]:
    """Every member of pack `file` into the staging directory `tmp`, each checked against the manifest (its
    first member) as it is written: the manifest, the files it lists and the paths extracted."""
    reader, tar = _open(file)
    with reader:
        raw, manifest = _read_manifest_member(tar, file)
        expected = manifest_files(manifest)
        need = sum(r.size for r in expected.values())
        free = shutil.disk_usage(tmp).free
        if need > free:
            raise BundleError("pack %s needs %d bytes unpacked, %s has %d free; free some space or unpack "
                              "elsewhere" % (file, need, out.parent, free))
        (tmp / MANIFEST).write_bytes(raw)
        seen: set = set()
        with progress.task("unpack %s" % file, total=need, unit="bytes") as line:
            while True:
                member = tar.next()
                if member is None:
                    break
                why = _refuse(member, expected, seen)
                if why:
                    raise BundleError("pack %s refused: %s; nothing was unpacked" % (file, why))
                rel = PurePosixPath(member.name).as_posix()
                seen.add(rel)
                digest = _extract(tar, tmp / rel, member.size)
                line.advance(member.size)
                if digest != expected[rel].sha256:
                    raise BundleError("pack %s refused: %s has sha256 %s... after extraction, its manifest "
                                      "says %s...; nothing was unpacked" % (file, rel, digest[:12],
                                                                           expected[rel].sha256[:12]))
    return manifest, expected, seen


__all__ = ["ENV_MAX_RATIO", "MAX_MEMBERS", "MAX_NAME_BYTES", "MAX_PAX_BYTES", "MAX_RATIO", "MAX_UNPACKED_BYTES",
           "MIN_UNPACK_BYTES", "PackInfo", "pack", "read_pack_manifest", "read_pack_manifest_bytes", "unpack",
           "unpack_limit"]
