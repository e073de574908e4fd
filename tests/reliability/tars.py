"""Raw tar bytes, header by header, for crafting archives tarfile would not write (huge declared sizes,
wrong checksums, any type flag): what the archive tests and the archive fuzzer build packs from."""
from __future__ import annotations

from pathlib import Path

import zstandard


def header(name: bytes, size: int, kind: bytes = b"0", checksum: bool = True, linkname: bytes = b"") -> bytearray:
    """One ustar header block (sizes beyond octal in base-256, as GNU writes them; a negative size too)."""
    h = bytearray(512)
    h[0:len(name[:100])] = name[:100]
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    if 0 <= size < 8 ** 11:
        h[124:136] = b"%011o\0" % size
    else:
        h[124:136] = (b"\xff" if size < 0 else b"\x80") + (size % (1 << 88)).to_bytes(11, "big")
    h[136:148] = b"00000000000\0"
    h[156:157] = kind[:1]
    h[157:157 + len(linkname[:100])] = linkname[:100]
    h[257:263] = b"ustar\0"
    h[263:265] = b"00"
    if checksum:
        fix(h)
    return h


def fix(h: bytearray) -> bytearray:
    """Recompute a header's checksum after an edit."""
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return h


def member(name: str, data: bytes, kind: bytes = b"0") -> bytes:
    return bytes(header(name.encode("utf-8", "surrogateescape"), len(data), kind)) + data + bytes(-len(data) % 512)


def pax(records: dict, name: str = "PaxHeaders/x") -> bytes:
    """A pax extended header (type x) holding `records`, each `LEN key=value\\n`."""
    body = b""
    for k, v in records.items():
        rec = b" %s=%s\n" % (k.encode(), v if isinstance(v, bytes) else str(v).encode())
        n = len(rec) + 1
        while len(str(n)) + len(rec) != n:
            n = len(str(n)) + len(rec)
        body += str(n).encode() + rec
    return member(name, body, b"x")


def end() -> bytes:
    return bytes(1024)


def write_pack(path: Path, raw_tar: bytes, level: int = 1) -> Path:
    path.write_bytes(zstandard.ZstdCompressor(level=level).compress(raw_tar))
    return path


def write_huge(path: Path, head: bytes, declared: int, real: int = 64 << 20) -> Path:
    """A pack whose tar has `head`, then min(declared, real) zero bytes (which compress to almost nothing)."""
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=1).stream_writer(f) as z:
        z.write(head)
        zero = bytes(1 << 20)
        for _ in range(min(declared, real) >> 20):
            z.write(zero)
    return path
