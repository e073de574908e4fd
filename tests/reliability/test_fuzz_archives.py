"""Crafted packs against `unpack`, `read_pack_manifest` and the loader's pack path (`resolve_for_load`):
nothing may escape as another exception, write outside the target, leave a partial directory, hang, or
make memory grow with what an archive declares (issue 21).

The packs are built in memory from one small real bundle whose files are swapped for small blobs (the
manifest re-hashed to match: the checks behind the hashes are reached too). Each case applies one or
two mutations at the level of raw 512-byte headers: huge or malformed pax records and GNU long names,
hostile names (`..`, absolute, NUL, 5,000 bytes, a file that is another's directory), type flags
(links, devices, directories, FIFOs, sparse), size fields (octal, base-256, negative), damaged
checksums, duplicated, extra, missing and reordered members, thousands of headers, truncation, garbage.
Counted: escapes (any exception but BundleError), writes outside the target, refusals slower than
5 s, and resident memory growth over the whole run.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import time
from collections import Counter
from pathlib import Path

import pytest

from laya_aot.distribution.fetch import resolve_for_load
from laya_aot.distribution.pack import read_pack_manifest, unpack
from laya_aot.manifest import MANIFEST, BundleError

from .tars import end, fix, header, member, pax, write_pack

CASES = int(os.environ.get("LAYA_AOT_ARCHIVE_CASES", "240"))
HEAVY_CASES = int(os.environ.get("LAYA_AOT_ARCHIVE_CASES_HEAVY", "3000"))
HOSTILE_NAMES = ["../escaped", "/tmp/laya-aot-fuzz-escaped", "a/../../escaped", "onnx", "onnx/model.onnx/x",
                 "", ".", "x\\y", "bundle.json", "onnx/model.onnx", "exported_program", "a" * 5000,
                 "onnx/\udcff", "./onnx/model.onnx", "onnx//model.onnx"]
HUGE = [1 << 16, (1 << 16) + 1, 1 << 20, 1 << 30, 3 << 30, 1 << 40, 1 << 62, 8 ** 11 - 1]


@pytest.fixture(scope="module")
def base(small_bundle) -> dict:
    """The small bundle's manifest with every file replaced by a few bytes, and those files."""
    m = json.loads((small_bundle / MANIFEST).read_text())
    files = {}
    for a in m["artifacts"]:
        for rel in list(a.get("files") or {}):
            data = ("%s of %s\n" % (rel, a["name"])).encode() * 3
            files[rel] = data
            a["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        if a.get("files"):
            recs = a["files"]
            path = a["path"]
            if list(recs) == [path]:
                a["sha256"] = recs[path]["sha256"]
            else:
                h = hashlib.sha256()
                for rel in sorted(recs, key=lambda r: r.split("/")):
                    inner = rel[len(path.rstrip("/")) + 1:]
                    h.update(inner.encode() + b"\0" + recs[rel]["sha256"].encode() + b"\n")
                a["sha256"] = h.hexdigest()
            a["size"] = sum(r["size"] for r in recs.values())
    return {"manifest": m, "files": files}


def _members(base: dict, manifest: dict | None = None) -> list:
    raw = json.dumps(manifest or base["manifest"]).encode()
    return [member(MANIFEST, raw)] + [member(rel, data) for rel, data in sorted(base["files"].items())]


def _mutate(rng: random.Random, base: dict) -> tuple:
    """(raw tar bytes, what was done)."""
    ms = _members(base)
    how = rng.choice(["pax_size", "pax_path", "pax_record", "longname", "header_bytes", "size_field", "type",
                      "duplicate", "extra", "missing", "reorder", "truncate", "many_headers", "manifest", "garbage",
                      "link", "checksum", "global_pax", "longname_huge", "pax_malformed"])
    at = rng.randrange(0, len(ms) + 1)
    if how == "pax_size":
        ms.insert(at, bytes(header(b"PaxHeaders/x", rng.choice(HUGE), b"x")))
    elif how == "pax_path":
        ms.insert(max(at, 1), pax({"path": rng.choice(HOSTILE_NAMES).encode("utf-8", "surrogateescape")}))
    elif how == "pax_record":
        ms.insert(max(at, 1), pax({"size": rng.choice(["-1", "abc", str(1 << 62), "0", "7", ""])}))
    elif how == "pax_malformed":
        body = rng.choice([b"99999 path=x\n", b"5 a=b\n", b"x path=y\n", b"12 path=abc", b"0 =\n", b"\n" * 40])
        ms.insert(max(at, 1), member("PaxHeaders/x", body, b"x"))
    elif how == "global_pax":
        ms.insert(max(at, 1), pax({"path": "../g"}, "GlobalHead/x"))
        h = bytearray(ms[max(at, 1)][:512])
        h[156:157] = b"g"
        ms[max(at, 1)] = bytes(fix(h)) + ms[max(at, 1)][512:]
    elif how == "longname":
        name = rng.choice(HOSTILE_NAMES).encode("utf-8", "surrogateescape") + b"\0"
        ms.insert(max(at, 1), member("././@LongLink", name, b"L"))
        h = bytearray(ms[max(at, 1)][:512])
        h[156:157] = b"L"
        ms[max(at, 1)] = bytes(fix(h)) + ms[max(at, 1)][512:]
    elif how == "longname_huge":
        ms.insert(at, bytes(header(b"././@LongLink", rng.choice(HUGE), rng.choice([b"L", b"K"]))))
    elif how in ("header_bytes", "checksum", "size_field", "type"):
        i = rng.randrange(len(ms))
        h = bytearray(ms[i][:512])
        if how == "header_bytes":
            for _ in range(rng.randint(1, 8)):
                h[rng.randrange(512)] = rng.randrange(256)
            if rng.random() < 0.7:
                fix(h)
        elif how == "checksum":
            h[148:156] = rng.choice([b"0000000\0", b"zzzzzzz\0", b"\x80" * 8, b"       \0"])
        elif how == "size_field":
            size = rng.choice(HUGE + [-1, -(1 << 40), 0, 1, 511, 513])
            h[124:136] = header(b"x", size)[124:136]
            if rng.random() < 0.3:
                h[124:136] = b"9" * 11 + b"\0"
            fix(h)
        else:
            h[156:157] = rng.choice([b"1", b"2", b"3", b"4", b"5", b"6", b"7", b"S", b"V", b"M", b"N", b"D", b"Z"])
            if h[156:157] in (b"1", b"2"):
                h[157:170] = b"/etc/passwd\0\0"
            fix(h)
        ms[i] = bytes(h) + ms[i][512:]
    elif how == "duplicate":
        i = rng.randrange(1, len(ms))
        ms.insert(rng.randrange(1, len(ms) + 1), ms[i])
    elif how == "extra":
        ms.insert(max(at, 1), member(rng.choice(HOSTILE_NAMES[:12] + ["unlisted.bin"]), b"payload"))
    elif how == "missing":
        del ms[rng.randrange(1, len(ms))]
    elif how == "reorder":
        rng.shuffle(ms)
    elif how == "many_headers":
        ms.insert(max(at, 1), pax({"mtime": "0"}) * rng.choice([2, 5, 50, 5000]))
    elif how == "manifest":
        m = json.loads(json.dumps(base["manifest"]))
        a = rng.choice([x for x in m["artifacts"] if x.get("files")])
        rel = next(iter(a["files"]))
        choice = rng.choice(["prefix", "size_huge", "many_files", "size_negative", "declared_huge"])
        if choice == "prefix":   # a file of one artifact is another's directory, hashes consistent
            data = b"collide"
            sha = hashlib.sha256(data).hexdigest()
            extra = json.loads(json.dumps(a))
            top = rel.split("/")[0]
            extra.update(name="collide", path=top, sha256=sha, size=len(data),
                         files={top: {"sha256": sha, "size": len(data)}})
            m["artifacts"].append(extra)
            ms = _members(base, m)
            ms.insert(1, member(top, data))
        elif choice == "size_huge":
            a["files"][rel]["size"] = 1 << 50
            a["size"] = sum(r["size"] for r in a["files"].values())
            ms = _members(base, m)
        elif choice == "size_negative":
            a["files"][rel]["size"] = -5
            ms = _members(base, m)
        elif choice == "many_files":
            a["files"].update({"%s.%d" % (rel, k): {"sha256": "0" * 64, "size": 1} for k in range(120_000)})
            ms = _members(base, m)
        else:
            ms[0] = bytes(header(MANIFEST.encode(), rng.choice(HUGE), b"0"))
    elif how == "truncate":
        raw = b"".join(ms) + end()
        return raw[: rng.randrange(0, len(raw))], how
    elif how == "garbage":
        ms.insert(max(at, 1), bytes(rng.randrange(256) for _ in range(rng.choice([1, 511, 512, 1500]))))
    elif how == "link":
        name = next(iter(base["files"]))
        info = bytes(header(name.encode(), 0, rng.choice([b"1", b"2"]), linkname=b"../../../../etc/passwd"))
        ms = [x for x in ms if not x[:100].rstrip(b"\0") == name.encode()]
        ms.insert(max(at, 1), info)
    return b"".join(ms) + (end() if rng.random() < 0.9 else b""), how


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _tree(root: Path) -> list:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def _fuzz(base: dict, root: Path, n: int, seed: int) -> Counter:
    tally: Counter = Counter()
    escapes, slow = [], []
    rss0 = _rss_mb()
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        raw, how = _mutate(rng, base)
        case = root / ("c%d" % i)
        case.mkdir()
        file = write_pack(case / "p.tar.zst", raw)
        target = case / "into" / "bundle"
        t0 = time.perf_counter()
        try:
            m = unpack(file, target)
            listed = {r for a in m.artifacts if a.built for r in a.files} | {MANIFEST}
            assert {p for p in _tree(target) if (target / p).is_file()} == listed
            tally["unpacked"] += 1
        except BundleError as e:
            assert "\n" not in str(e) and len(str(e)) < 2000, (how, str(e)[:3000])
            assert not target.exists(), (how, str(e))
            tally["refused"] += 1
        except Exception as e:  # noqa: BLE001 - what the test counts
            escapes.append((i, how, "%s: %s" % (type(e).__name__, str(e)[:300])))
        try:
            read_pack_manifest(file)
        except BundleError:
            pass
        except Exception as e:  # noqa: BLE001
            escapes.append((i, how, "read_pack_manifest %s: %s" % (type(e).__name__, str(e)[:300])))
        if i % 4 == 0:  # the loader's pack path: one reason, never a raise
            try:
                resolve_for_load(str(file), "cpu", None)
            except Exception as e:  # noqa: BLE001
                escapes.append((i, how, "resolve_for_load %s: %s" % (type(e).__name__, str(e)[:300])))
        seconds = time.perf_counter() - t0
        if seconds > 5:
            slow.append((i, how, round(seconds, 1)))
        outside = [p for p in _tree(case) if not (p in ("p.tar.zst", "into") or p.startswith("into/bundle"))]
        assert not outside, (i, how, outside)
        tally[how] += 1
    assert not Path("/tmp/laya-aot-fuzz-escaped").exists() and not (root / "escaped").exists()
    assert not escapes, escapes[:10]
    assert not slow, slow[:10]
    grew = _rss_mb() - rss0
    assert grew < 300, "resident memory grew by %.0f MB over %d archives" % (grew, n)
    tally["rss_growth_mb"] = int(grew)
    return tally


def test_crafted_archives_are_refused_or_unpacked_exactly(base, tmp_path):
    tally = _fuzz(base, tmp_path, CASES, 1)
    assert tally["refused"] >= CASES // 2 and tally["unpacked"] >= 1, tally
    print("archive fuzz (%d cases): %s" % (CASES, dict(tally)))


@pytest.mark.heavy
def test_crafted_archives_heavy(base, tmp_path):
    tally = _fuzz(base, tmp_path, HEAVY_CASES, 2)
    print("archive fuzz heavy (%d cases): %s" % (HEAVY_CASES, dict(tally)))
