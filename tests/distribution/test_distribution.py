"""Partial bundles built apart, merged, packed, unpacked and fetched one variant at a time (issue 13).

The CI job's commands run as a person would run them: two `laya-aot build` processes make the CPU
artifacts and TileLang kernels cross-compiled for sm_90a, `laya-aot merge` joins them, `pack` and
`unpack` carry the result, and the runtime loads it with strict=True. Hostile archives and merges are
refused with one error each and leave nothing behind. The `hf://` tests run `huggingface_hub` itself
against a small local server that speaks the Hub's file-download protocol (HEAD/GET
`/{repo}/resolve/{revision}/{path}` with X-Repo-Commit and ETag), counting the files it is asked for.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from laya_aot import kinds
from laya_aot.bundle_format import read_bundle
from laya_aot.cli import main as cli
from laya_aot.distribution.fetch import parse_hf, resolve
from laya_aot.distribution.merge import merge
from laya_aot.distribution.pack import pack, read_pack_manifest, unpack
from laya_aot.kinds.usable import usable_here
from laya_aot.manifest import MANIFEST, BundleError
from tests.conftest import FEW_DECISIONS

zstandard = pytest.importorskip("zstandard")
pytest.importorskip("tilelang", reason="the tilelang extra is not installed (cross-compiles the sm_90a part)")

# 8 rows and conftest.FEW_DECISIONS in both parts (a merge needs one tolerance); neither ships its portable program
# (export.ship_program is off by default), so the parts hold ONNX and the sm_90a kernels
SMALL = ["export.max_rows=8", *FEW_DECISIONS]
CPU_PART = ["stages.aoti=false", *SMALL]  # the CPU artifacts: ONNX (AOTInductor is the slow one to build)
TILELANG_PART = ["target=sm_90", "stages.aoti=false", "stages.onnx=false", "stages.inductor_cache=false", *SMALL]


def _build_cmd(ckpt: Path, out: Path, overrides) -> list:
    return [sys.executable, "-m", "laya_aot.cli", "build", "checkpoint.path=%s" % ckpt, "output_dir=%s" % out,
            *overrides]


def _run_builds(*cmds) -> None:
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]


@pytest.fixture(scope="module")
def parts(demo_ckpt, tmp_path_factory):
    """Two partial bundles of the demo checkpoint, each built by its own `laya-aot build` process."""
    root = tmp_path_factory.mktemp("parts")
    cpu, tl = root / "cpu", root / "tilelang-sm_90a"
    _run_builds(_build_cmd(demo_ckpt, cpu, CPU_PART), _build_cmd(demo_ckpt, tl, TILELANG_PART))
    return cpu, tl


@pytest.fixture(scope="module")
def merged(parts, tmp_path_factory):
    out = tmp_path_factory.mktemp("merged") / "demo"
    assert cli(["merge", str(out), *map(str, parts)]) == 0
    return out


@pytest.fixture(scope="module")
def packed(merged, tmp_path_factory):
    file = tmp_path_factory.mktemp("packs") / "demo.tar.zst"
    assert cli(["pack", str(merged), str(file)]) == 0
    return file


def _leftovers(target: Path) -> list:
    return sorted(p.name for p in target.parent.glob(".%s*" % target.name))


# --- the Done-when test: the CPU job's commands, run locally ---------------------------------------------------

def test_partial_bundles_merge_pack_unpack_and_load_strict(parts, merged, packed, demo_ckpt, tmp_path):
    cpu, tl = parts
    m = read_bundle(merged, kinds.NAMES)
    names = {a.name: a for a in m.artifacts}
    # both parts are there, each artifact with its own build record and verify figures
    assert {"onnx-fp32", "tilelang-sm_90a"} <= set(names) and not any(n.startswith("exported_program") for n in names)
    for part in (cpu, tl):
        for a in read_bundle(part, kinds.NAMES).artifacts:
            assert names[a.name].sha256 == a.sha256 and names[a.name].verify == a.verify
            assert names[a.name].build_machine == a.build_machine and a.build_machine["machine"]
    assert names["tilelang-sm_90a"].status == "unverified" and names["tilelang-sm_90a"].needs.gpu_arch == "sm_90a"
    assert {p["name"] for p in m.target["parts"]} == {"cpu", "sm_90"}

    # the pack: the manifest is its first member, byte for byte; packing again gives the same bytes
    with zstandard.ZstdDecompressor().stream_reader(open(packed, "rb")) as z, tarfile.open(fileobj=z, mode="r|") as t:
        first = t.next()
        assert first.name == MANIFEST and t.extractfile(first).read() == (merged / MANIFEST).read_bytes()
    again = pack(merged, tmp_path / "again.tar.zst")
    assert again.sha256 == hashlib.sha256(packed.read_bytes()).hexdigest()

    fresh = tmp_path / "fresh" / "demo"
    assert cli(["unpack", str(packed), str(fresh)]) == 0
    assert (fresh / MANIFEST).read_bytes() == (merged / MANIFEST).read_bytes()
    listed = {rel for a in m.artifacts for rel in a.files}
    on_disk = {p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file()}
    assert on_disk == listed | {MANIFEST}

    import laya_aot

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya_aot.load(str(demo_ckpt), bundle=str(fresh), device="cpu", strict=True)
    assert agent.backend == "aot:onnx" and agent.backend_object.artifact.name == "onnx-fp32"
    ok, skipped = usable_here(m, "cpu")
    assert [a.name for a in ok] == ["onnx-fp32"]
    assert "the agent runs on cpu" in dict(skipped)["tilelang-sm_90a"]


def test_load_takes_a_pack_file_and_unpacks_it_once_into_the_cache(packed, demo_ckpt):
    import laya_aot

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya_aot.load(str(demo_ckpt), bundle=str(packed), device="cpu", strict=True)
    assert agent.backend == "aot:onnx"
    where = resolve(packed, device="cpu")
    assert where.parent.name == "packs" and (where / MANIFEST).read_bytes() == read_member(packed, MANIFEST)
    assert resolve(packed, device="cpu") == where


def test_a_pack_is_named_as_a_pack_and_a_file_that_is_not_one_is_named_so(merged, packed, demo_ckpt, tmp_path,
                                                                            capsys):
    """`pack` writes only names that fetch, load and serve know a pack by; a pack under another name is refused
    as a file that is not a pack (not as a bundle that "does not exist"), naming the rename."""
    import laya_aot
    from laya_aot.runtime.session import NoArtifactError

    assert cli(["pack", str(merged), str(tmp_path / "demo2")]) != 0
    assert "a pack's name ends in .tar.zst" in capsys.readouterr().err and not (tmp_path / "demo2").exists()
    renamed = tmp_path / "demo2"
    shutil.copyfile(packed, renamed)
    with pytest.raises(NoArtifactError, match="is a file, not a bundle directory or a pack: a pack's name ends in "
                                              r"\.tar\.zst") as e:
        laya_aot.load(str(demo_ckpt), bundle=str(renamed), device="cpu", strict=True)
    assert "does not exist" not in str(e.value)
    with pytest.raises(BundleError, match="is a file, not a bundle directory or a pack"):
        resolve(renamed)
    with pytest.raises(BundleError, match="does not exist"):
        from laya_aot.distribution.fetch import fetch

        fetch(tmp_path / "nope.tar.zst")


def test_a_pinned_pack_unpacked_in_the_cache_is_the_pins_even_against_a_forged_digest(packed, merged, demo_ckpt):
    """The unpacked pack lives in the cache: a file changed there (same size) beside a digest entry naming the
    manifest's sha256 for it used to serve the changed weights under the pin, without a word. Its files are hashed
    on every start: the change is found, the pack unpacked again, and the answers are the bundle's."""
    import hashlib

    import laya_aot
    from laya_aot import files
    from laya_aot.bundle_format import bundle_sha256
    from laya_aot.commands import DEMO_QUESTIONS, DEMO_STATES

    pin = bundle_sha256(merged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clean = laya_aot.load(str(demo_ckpt), bundle=str(packed), device="cpu", strict=True, bundle_sha256=pin,
                              prefer="onnx")
    want = clean.predict_batch(DEMO_STATES, DEMO_QUESTIONS)
    where = resolve(packed, device="cpu")
    model = next(where.rglob("*.onnx"))
    raw = bytearray(model.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 4096] = bytes(b ^ 0x55 for b in raw[middle:middle + 4096])
    model.write_bytes(bytes(raw))
    recorded = next(rec for a in read_bundle(where, kinds.BY_NAME).artifacts for rel, rec in a.files.items()
                    if (where / rel) == model)
    key = hashlib.sha256(files._stat_key(model).encode()).hexdigest()
    (files.cache_dir() / "digests" / (key + ".json")).write_text(json.dumps({"path": str(model.resolve()),
                                                                          "sha256": recorded.sha256}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = laya_aot.load(str(demo_ckpt), bundle=str(packed), device="cpu", strict=True, bundle_sha256=pin,
                              prefer="onnx")
    assert again.backend == "aot:onnx"
    assert again.predict_batch(DEMO_STATES, DEMO_QUESTIONS) == want
    assert files.sha256_file(resolve(packed, device="cpu") / model.relative_to(where)) == recorded.sha256


def test_a_load_waits_for_another_process_unpacking_the_same_pack(packed, demo_ckpt, tmp_path, monkeypatch):
    """The workers of one server start together on one pack: the one that finds the cache's copy being written
    waits for it instead of serving laya's eager forward (strict: failing) because the output was busy."""
    import laya_aot
    from laya_aot import files, staging

    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    target = files.cache_dir() / "packs" / files.sha256_file(packed)[:32]
    held, release = threading.Event(), threading.Event()

    def other_process_unpacking() -> None:
        with staging.writing(target):
            held.set()
            release.wait(30)

    other = threading.Thread(target=other_process_unpacking)
    other.start()
    assert held.wait(30)
    threading.Timer(1.5, release.set).start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya_aot.load(str(demo_ckpt), bundle=str(packed), device="cpu", strict=True)
    other.join(30)
    assert release.is_set() and agent.backend == "aot:onnx"


def read_member(file: Path, name: str) -> bytes:
    with zstandard.ZstdDecompressor().stream_reader(open(file, "rb")) as z, tarfile.open(fileobj=z, mode="r|") as t:
        for m in t:
            if m.name == name:
                return t.extractfile(m).read()
    raise KeyError(name)


def test_a_directory_of_packs_gives_the_pack_this_machine_can_use(parts, packed, tmp_path):
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    pack(parts[1], shelf / "a-tilelang-only.tar.zst")  # nothing in it runs on a CPU
    shutil.copy(packed, shelf / "b-merged.tar.zst")
    got = resolve(shelf, device="cpu")
    assert read_bundle(got, kinds.NAMES).artifact("onnx-fp32").status == "verified"
    assert read_pack_manifest(shelf / "a-tilelang-only.tar.zst").of_kind("tilelang")


# --- merges that must be refused -----------------------------------------------------------------------------

def _edit(bundle: Path, fn) -> None:
    data = json.loads((bundle / MANIFEST).read_text())
    fn(data)
    (bundle / MANIFEST).write_text(json.dumps(data))


def test_merge_refuses_two_fingerprints_and_leaves_nothing(parts, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(parts[1], other)
    _edit(other, lambda m: m["checkpoint"]["fingerprint"].update(sha256="0" * 64))  # as if built from another one
    out = tmp_path / "out"
    with pytest.raises(BundleError) as e:
        merge(out, [parts[0], other])
    assert str(e.value).count("\n  - ") == 1 and "another checkpoint" in str(e.value)
    assert not out.exists() and _leftovers(out) == []


def test_merge_lists_every_conflict_of_a_different_export(parts, demo_bundle, tmp_path):
    """A real build of the same checkpoint with other export settings (the demo bundle: 64 rows, where the
    parts have 8, and the default decision suite): its ONNX model, ranges and smoke batch all differ, and each is
    one line of the one error (the demo bundle ships no portable program: export.ship_program)."""
    out = tmp_path / "out"
    with pytest.raises(BundleError) as e:
        merge(out, [parts[0], demo_bundle])
    lines = str(e.value).split("\n  - ")[1:]
    assert any("other ranges" in x for x in lines), lines
    assert any("onnx-fp32: different programs" in x for x in lines), lines
    assert not out.exists() and _leftovers(out) == []


def test_merge_keeps_identical_duplicates_once_and_rechecks_every_hash(parts, tmp_path):
    out = tmp_path / "same"
    b = merge(out, [parts[0], parts[0]])
    assert sorted(a.name for a in b.artifacts) == sorted(a.name for a in read_bundle(parts[0], kinds.NAMES).artifacts)
    damaged = tmp_path / "damaged"
    shutil.copytree(parts[0], damaged)
    onnx = damaged / "onnx" / "model.onnx"
    data = bytearray(onnx.read_bytes())
    data[-1] ^= 1
    onnx.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"onnx-fp32 in .*damaged: onnx/model.onnx has sha256"):
        merge(tmp_path / "out", [damaged, parts[1]])
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path / "out") == []


# --- archives that must be refused ----------------------------------------------------------------------------

def _archive(path: Path, manifest: bytes, members) -> Path:
    """A zstd tar of bundle.json and `members`: (TarInfo, bytes or None)."""
    with open(path, "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as z, \
            tarfile.open(fileobj=z, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _reg(name: str, data: bytes) -> tuple:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str, hard: bool = False) -> tuple:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    info.linkname = target
    return info, None


def _members(bundle: Path):
    m = read_bundle(bundle, kinds.NAMES)
    for rel in sorted({r for a in m.artifacts for r in a.files}):
        yield _reg(rel, (bundle / rel).read_bytes())


def _flip(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


HOSTILE = {
    "path traversal": (lambda b: [*_members(b), _reg("../escaped.txt", b"x")], "a '..' component"),
    "absolute path": (lambda b: [*_members(b), _reg("/tmp/laya-aot-escaped.txt", b"x")], "an absolute path"),
    "a link escaping the target": (
        lambda b: [_link("onnx/model.onnx", "../../../../etc/passwd") if i.name == "onnx/model.onnx" else (i, d)
                   for i, d in _members(b)], "a symbolic link"),
    "a hard link": (lambda b: [_link("onnx/model.onnx", "/etc/passwd", hard=True) if i.name == "onnx/model.onnx"
                               else (i, d) for i, d in _members(b)], "a hard link"),
    "a member not in the manifest": (lambda b: [*_members(b), _reg("onnx/extra.bin", b"payload")],
                                     "not a file its manifest lists"),
    "hash mismatch after extraction": (
        lambda b: [_reg(i.name, _flip(d)) if i.name == "onnx/model.onnx" else (i, d) for i, d in _members(b)],
        r"onnx/model.onnx has sha256 .* after extraction"),
    "a size that differs": (
        lambda b: [_reg(i.name, d + b"\0") if i.name == "onnx/model.onnx" else (i, d) for i, d in _members(b)],
        "bytes, its manifest says"),
    "a missing file": (lambda b: [(i, d) for i, d in _members(b) if i.name != "onnx/model.onnx"],
                       "lacks 1 file"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archives_are_refused_and_leave_nothing(merged, tmp_path, case):
    members, message = HOSTILE[case]
    file = _archive(tmp_path / "hostile.tar.zst", (merged / MANIFEST).read_bytes(), members(merged))
    target = tmp_path / "into" / "bundle"
    with pytest.raises(BundleError, match=message) as e:
        unpack(file, target)
    assert "\n" not in str(e.value)
    assert not target.exists() and _leftovers(target) == []
    assert not (tmp_path / "escaped.txt").exists() and not Path("/tmp/laya-aot-escaped.txt").exists()


def test_a_truncated_archive_is_one_clear_error(packed, tmp_path):
    cut = tmp_path / "cut.tar.zst"
    cut.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    target = tmp_path / "bundle"
    with pytest.raises(BundleError, match="truncated or damaged") as e:
        unpack(cut, target)
    assert "copy or download it again" in str(e.value)
    assert not target.exists() and _leftovers(target) == []
    assert cli(["unpack", str(cut), str(target)]) == 2 and not target.exists()


def test_an_archive_whose_manifest_is_not_first_or_not_ours_is_refused(merged, tmp_path):
    file = tmp_path / "x.tar.zst"
    with open(file, "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as z, \
            tarfile.open(fileobj=z, mode="w|") as tar:
        info, data = _reg("onnx/model.onnx", b"abc")
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match="does not start with bundle.json"):
        unpack(file, tmp_path / "b")
    bad = _archive(tmp_path / "y.tar.zst", b'{"schema": "something-else"}', [])
    with pytest.raises(BundleError, match="not a laya-aot manifest"):
        unpack(bad, tmp_path / "b")
    assert not (tmp_path / "b").exists() and _leftovers(tmp_path / "b") == []


def test_unpack_never_overwrites_a_directory_that_is_not_a_bundle(packed, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match="not a laya-aot bundle"):
        unpack(packed, home)
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt"]


# --- hf:// : huggingface_hub against a local server that speaks the Hub's download protocol ------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class _Hub:
    """Serves directory `root` as model repo ORG/REPO at every revision (one commit), logging each request."""

    def __init__(self, root: Path, repo: str):
        self.requests: list = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _file(self):
                prefix = "/%s/resolve/" % repo
                if not self.path.startswith(prefix):
                    return None
                rev, _, rel = self.path[len(prefix):].partition("/")
                p = root / rel
                return p if rel and ".." not in rel.split("/") and p.is_file() else None

            def _headers(self, p):
                data = p.read_bytes()
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", '"%s"' % hashlib.sha256(data).hexdigest())
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return data

            def _missing(self):
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self):
                hub.requests.append(("HEAD", self.path))
                p = self._file()
                self._headers(p) if p else self._missing()

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                p = self._file()
                if p is None:
                    return self._missing()
                self.wfile.write(self._headers(p))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def gets(self) -> list:
        return sorted(p for method, p in self.requests if method == "GET")

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(merged, tmp_path):
    repo_root = tmp_path / "repo"
    shutil.copytree(merged, repo_root / "demo")  # the bundle lives under PATH=demo in the repository
    h = _Hub(repo_root, "acme/bundles")
    yield h
    h.close()


def _hf_env(tmp_path: Path, hub: _Hub, offline: bool = False) -> dict:
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_XET="1")
    env.pop("HF_TOKEN", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def _fetch(spec: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "laya_aot.cli", "fetch", spec, "--device", "cpu"], env=env,
                          capture_output=True, text=True, timeout=300)


def test_parse_hf_addresses():
    assert parse_hf("hf://acme/bundles") == ("acme/bundles", "", None)
    assert parse_hf("hf://acme/bundles/demo/cpu@v1.2") == ("acme/bundles", "demo/cpu", "v1.2")
    for bad in ("hf://acme", "hf://acme/bundles@", "hf://acme/bundles/../x"):
        with pytest.raises(BundleError, match="hf://ORG/REPO"):
            parse_hf(bad)


def test_hf_fetch_downloads_only_the_usable_variant_then_works_offline(hub, merged, demo_ckpt, tmp_path):
    m = read_bundle(merged, kinds.NAMES)
    want = {"/acme/bundles/resolve/main/demo/bundle.json"} | {
        "/acme/bundles/resolve/%s/demo/%s" % (COMMIT, rel) for rel in m.artifact("onnx-fp32").files}
    p = _fetch("hf://acme/bundles/demo", _hf_env(tmp_path, hub))
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(set(hub.gets())) == sorted(want) and len(hub.gets()) == len(want), hub.requests
    assert len(m.artifact("tilelang-sm_90a").files) > 10  # what was not downloaded is most of the bundle
    assert "artifacts usable here: onnx-fp32" in p.stdout and "not fetched: tilelang-sm_90a" in p.stdout
    local = Path(p.stdout.split(" into ", 1)[1].splitlines()[0])
    assert not (local / "tilelang").exists() and not any(x.is_symlink() for x in local.rglob("*"))

    # offline, from the cache alone: the same bundle, no request reaches the server
    hub.requests.clear()
    offline = _hf_env(tmp_path, hub, offline=True)
    p = _fetch("hf://acme/bundles/demo", offline)
    assert p.returncode == 0, p.stdout + p.stderr
    p = _fetch("hf://acme/bundles/demo@%s" % COMMIT, offline)  # a pinned revision
    assert p.returncode == 0, p.stdout + p.stderr
    code = ("import warnings, laya_aot; warnings.simplefilter('ignore'); a = laya_aot.load(%r, "
            "bundle='hf://acme/bundles/demo', device='cpu', strict=True); print(a.backend)" % str(demo_ckpt))
    p = subprocess.run([sys.executable, "-c", code], env=offline, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("aot:onnx"), p.stdout + p.stderr
    assert hub.requests == []

    # a revision the cache never saw, offline: one clear error, from the command and from the loader
    p = _fetch("hf://acme/bundles/demo@v9", offline)
    assert p.returncode == 2 and "HF_HUB_OFFLINE is set" in p.stderr and "Traceback" not in p.stderr, p.stderr
