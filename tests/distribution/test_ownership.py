"""Only what laya-aot made can be deleted by it, disk use is bounded, and a killed command's leftovers go with the
next run (issue 55, "What to build" 3 and 4).

Leftovers: every directory-writing command (build, make-demo, demo, merge, unpack, fetch) removes the marked
staging directory a killed run left beside its output, and nothing else named like one. Ownership: a hand-written
manifest and a demo checkpoint whose weights were edited in place are not laya-aot's to replace. Disk: a pack
declaring more than `pack.unpack_limit` allows is refused before a byte is written.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import laya_aot
from laya_aot import kinds, staging
from laya_aot.bundle_format import read_bundle
from laya_aot.distribution import pack as pack_mod
from laya_aot.distribution.pack import pack, read_pack_manifest, unpack
from laya_aot.manifest import MANIFEST, BundleError, FileRecord, files_digest
from tests.distribution.test_safety import _one_line, _run
from tests.leftovers import intact, killed_leftover, user_lookalikes
from tests.reliability.tars import header as _header
from tests.reliability.tars import member as _member
from tests.reliability.tars import write_huge as _write_huge

pytest.importorskip("zstandard")


@pytest.fixture(scope="module")
def small_pack(small_bundle, tmp_path_factory) -> Path:
    return pack(small_bundle, tmp_path_factory.mktemp("packs") / "small.tar.zst").path


def _beside(out: Path) -> tuple:
    """A killed run's leftover and a user's look-alikes beside `out`."""
    return killed_leftover(out), user_lookalikes(out)


def _cleaned(out: Path, leftover: Path, made: dict) -> None:
    assert not leftover.exists(), "the killed run's staging directory was not removed"
    intact(made)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".%s.partial-" % out.name)
                and not (p / "thesis.tex").exists()], "a staging directory of this run was left behind"


# --- leftovers: the six directory-writing commands ------------------------------------------------------------

@pytest.mark.parametrize("command", ["merge", "unpack", "fetch"])
def test_distribution_commands_remove_a_killed_runs_leftover_and_nothing_a_user_named_like_one(
        small_bundle, small_pack, tmp_path, command):
    out = tmp_path / "out"
    leftover, made = _beside(out)
    argv = {"merge": ["merge", out, small_bundle], "unpack": ["unpack", small_pack, out],
            "fetch": ["fetch", small_pack, "--out", out, "--device", "cpu"]}[command]
    rc, text = _run(argv)
    assert rc == 0, text
    _cleaned(out, leftover, made)
    assert staging.complete_bundle(out) is None


def test_make_demo_removes_a_killed_runs_leftover_and_nothing_a_user_named_like_one(tmp_path):
    out = tmp_path / "ckpt"
    leftover, made = _beside(out)
    rc, text = _run(["make-demo", out])
    assert rc == 0, text
    _cleaned(out, leftover, made)


def test_demo_removes_a_killed_runs_leftover_and_nothing_a_user_named_like_one(small_bundle, tmp_path, monkeypatch):
    """`laya-aot demo` writes its demo checkpoint (and, without a bundle, builds one: the build's own test below)."""
    from laya_aot import demo

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "DEMO_SHAPE", "tiny")  # the command's own checkpoint, without a minute of training
    out = tmp_path / "artifacts" / "checkpoints" / "demo-tiny-seed0"
    leftover, made = _beside(out)
    rc, text = _run(["demo", "--bundle", small_bundle])
    assert rc == 0, text
    assert (out / "model.safetensors").is_file()
    _cleaned(out, leftover, made)


def test_build_removes_a_killed_runs_leftover_and_nothing_a_user_named_like_one(demo_ckpt, tmp_path, monkeypatch):
    """The build's staging transaction, up to the point where no stage ran: what it removes beside the output is
    decided before any stage (`staging.new_staging`), and its own staging goes when it fails."""
    from laya_aot.config import compose
    from laya_aot.pipeline import BuildError, build
    from laya_aot.pipeline import stages as stages_mod

    out = tmp_path / "out"
    leftover, made = _beside(out)
    monkeypatch.setattr(stages_mod, "stages", lambda dtypes: [])
    with pytest.raises(BuildError, match="no artifact could be built"):
        build(compose(["checkpoint.path=%s" % demo_ckpt, "output_dir=%s" % out]))
    _cleaned(out, leftover, made)
    assert not out.exists()


# --- what stale_reason keeps ----------------------------------------------------------------------------------

def test_only_a_marked_directory_of_a_gone_owner_of_this_user_is_stale(tmp_path):
    out = tmp_path / "out"
    leftover = killed_leftover(out)
    assert staging.stale_reason(leftover, "out") is None
    made = user_lookalikes(out)
    reasons = {d.parent.name: staging.stale_reason(d.parent, "out") for d in made}
    assert "no laya-aot marker" in reasons[".out.partial-0123456789abcdef"]
    assert "not one laya-aot gives" in reasons[".out.partial-mine"]
    assert "not the one laya-aot wrote" in reasons[".out.partial-00000000000000aa"]
    assert "still running" in reasons[".out.partial-00000000000000bb"]
    # a pid reused by another process since the marker was written: its owner is gone
    marker = json.loads((leftover / staging.MARKER).read_text())
    if marker["started"] is not None:
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            (leftover / staging.MARKER).write_text(json.dumps(dict(marker, pid=sleeper.pid)))
            assert staging.stale_reason(leftover, "out") is None
            (leftover / staging.MARKER).write_text(json.dumps(dict(marker, pid=sleeper.pid, started=None)))
            assert "still running" in staging.stale_reason(leftover, "out")
        finally:
            sleeper.kill()
            sleeper.wait()
    (leftover / staging.MARKER).write_text(json.dumps(dict(marker, pid=10 ** 30)))   # no process has that pid
    assert "not the one laya-aot wrote" in staging.stale_reason(leftover, "out")
    # a marker that is not a regular file (a FIFO would hang a reader) is no marker
    (leftover / staging.MARKER).unlink()
    os.mkfifo(leftover / staging.MARKER)
    assert "no laya-aot marker" in staging.stale_reason(leftover, "out")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_another_users_leftover_is_kept(tmp_path):
    leftover = killed_leftover(tmp_path / "out")
    os.chown(leftover, 4242, 4242)
    assert staging.stale_reason(leftover, "out") == "another user owns it"


def test_a_kill_while_the_replaced_output_is_removed_leaves_it_marked(small_bundle, tmp_path, monkeypatch):
    """What was at the output goes through a staging name; a kill while it is removed leaves it marked, and the
    next run removes it (its marker last: a kill halfway still leaves the marker)."""
    out = tmp_path / "out"
    shutil.copytree(small_bundle, out)
    removed = []
    real_remove = staging._remove

    def killed_midway(directory: Path) -> None:
        entries = sorted(p.name for p in directory.iterdir())
        removed.append(entries)
        assert staging.MARKER in entries, "what was at the output is removed unmarked"
        raise KeyboardInterrupt

    monkeypatch.setattr(staging, "_remove", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        with staging.staged(out) as tmp:
            shutil.copytree(small_bundle, tmp, dirs_exist_ok=True)
    monkeypatch.setattr(staging, "_remove", real_remove)
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert len(left) == 1 and staging.MARKER in removed[0]
    # the process that left it is this one: alive, so kept; once it is another (gone) process's, removed
    marker = json.loads((left[0] / staging.MARKER).read_text())
    assert "still running" in staging.stale_reason(left[0], "out")
    (left[0] / staging.MARKER).write_text(json.dumps(dict(marker, pid=2 ** 22 + 9)))
    staging.clean_stale(out)
    assert not left[0].exists() and staging.complete_bundle(out) is None


# --- hand-written manifests ---------------------------------------------------------------------------------

def _user_files(out: Path) -> dict:
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "thesis.tex").write_text("years of work")
    return {out / "notes.txt": "mine", out / "sub" / "thesis.tex": "years of work"}


def _v2_over_user_files(small_bundle: Path, out: Path, sizes: bool, digests: bool = True) -> None:
    """A copy of a real manifest whose artifacts list the user's files instead (a file, and a directory's file),
    their digests made to add up as the reader checks."""
    m = json.loads((small_bundle / MANIFEST).read_text())
    real = read_bundle(small_bundle, kinds.NAMES).artifacts[0]
    arts = []
    for name, path, rel in (("x", "notes.txt", "notes.txt"), ("y", "sub", "sub/thesis.tex")):
        data = (out / rel).read_bytes()
        rec = {"sha256": hashlib.sha256(data).hexdigest() if digests else "0" * 64, "size": len(data)}
        art = dict(m["artifacts"][0], name=name, path=path, size=len(data),
                   sha256=files_digest(replace(real, path=path, files={rel: FileRecord(**rec)})))
        if not sizes:
            rec.pop("size")
        arts.append(dict(art, files={rel: rec}))
    (out / MANIFEST).write_text(json.dumps(dict(m, artifacts=arts)))


HAND_WRITTEN = {
    "schema 1, one artifact at '.'": lambda small, out: (out / MANIFEST).write_text(json.dumps(
        {"schema": "laya-aot/bundle", "schema_version": 1, "artifacts": [{"name": "x", "path": "."}]})),
    "schema 2 listing the user's files without sizes": lambda small, out: _v2_over_user_files(small, out, False),
    "schema 2 listing the user's files at their sizes, other digests":
        lambda small, out: _v2_over_user_files(small, out, True, digests=False),
}


@pytest.mark.parametrize("case", sorted(HAND_WRITTEN))
def test_a_hand_written_manifest_does_not_open_replacement(small_bundle, small_pack, demo_ckpt, tmp_path, case):
    from laya_aot.config import compose
    from laya_aot.pipeline import BuildError, build

    out = tmp_path / "out"
    made = _user_files(out)
    HAND_WRITTEN[case](small_bundle, out)
    manifest = (out / MANIFEST).read_bytes()
    assert staging.complete_bundle(out) is not None
    for argv in (["merge", out, small_bundle], ["unpack", small_pack, out],
                 ["fetch", small_pack, "--out", out, "--device", "cpu"]):
        rc, text = _run(argv)
        assert rc == 2 and "--overwrite" in text and str(out) in text, (argv, text)
        _one_line(text)
    with pytest.raises(BuildError, match="overwrite=true"):
        build(compose(["checkpoint.path=%s" % demo_ckpt, "output_dir=%s" % out]))
    intact(made)
    assert (out / MANIFEST).read_bytes() == manifest


def test_a_bundle_whose_file_changed_in_place_at_its_size_is_not_laya_aots(small_bundle, small_pack, tmp_path):
    out = tmp_path / "out"
    assert _run(["unpack", small_pack, out])[0] == 0
    onnx = out / "onnx" / "model.onnx"
    data = bytearray(onnx.read_bytes())
    data[len(data) // 2] ^= 0xFF
    onnx.write_bytes(bytes(data))          # same size: only the sha256 tells
    why = staging.complete_bundle(out)
    assert why is not None and "onnx/model.onnx has sha256" in why
    rc, text = _run(["unpack", small_pack, out])
    assert rc == 2 and "--overwrite" in text
    assert onnx.read_bytes() == bytes(data)


# --- make-demo and a checkpoint edited in place ---------------------------------------------------------------

def test_make_demo_never_replaces_a_demo_checkpoint_whose_weights_were_edited(tmp_path):
    from laya_aot import demo

    ckpt = demo.make_checkpoint(tmp_path / "ckpt", "tiny", seed=0)
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01                       # one bit of the last tensor: fine-tuned in place, same size
    weights.write_bytes(bytes(data))
    for extra in (["--seed", "1"], []):   # another seed, and the very same request
        rc, text = _run(["make-demo", ckpt, *extra])
        assert rc == 2 and "model.safetensors changed" in text and "--overwrite" in text, text
        _one_line(text)
        assert weights.read_bytes() == bytes(data)
    rc, _ = _run(["make-demo", ckpt, "--seed", "1", "--overwrite"])
    assert rc == 0 and weights.read_bytes() != bytes(data) and demo._not_a_demo_checkpoint(ckpt) is None


def test_a_demo_checkpoint_without_its_record_is_reused_but_never_replaced(tmp_path):
    """One written before the record existed: the same request reuses it as before; another needs --overwrite."""
    from laya_aot import demo

    ckpt = demo.make_checkpoint(tmp_path / "ckpt", "tiny", seed=0)
    (ckpt / demo.RECORD).unlink()
    assert demo.make_checkpoint(ckpt, "tiny", seed=0) == ckpt and not (ckpt / demo.RECORD).exists()
    rc, text = _run(["make-demo", ckpt, "--seed", "1"])
    assert rc == 2 and demo.RECORD in text and "--overwrite" in text, text


# --- unpacking is bounded by the pack's size ------------------------------------------------------------------

def _written() -> int:
    """Bytes this process has handed to write() so far (Linux /proc/self/io)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def _declaring(small_bundle: Path, path: Path, declared: int, real: int) -> Path:
    """A pack whose manifest says onnx/model.onnx is `declared` bytes (of zeros, digest not theirs), the strict
    reader satisfied, holding `real` of them: a few kilobytes of pack."""
    m = json.loads((small_bundle / MANIFEST).read_text())
    built = {a.name: a for a in read_bundle(small_bundle, kinds.NAMES).artifacts}
    for a in m["artifacts"]:
        if "onnx/model.onnx" in (a.get("files") or {}):
            a["files"]["onnx/model.onnx"]["size"] = declared
            a["size"] = sum(r["size"] for r in a["files"].values())
            files = {rel: FileRecord(**rec) for rel, rec in a["files"].items()}
            a["sha256"] = files_digest(replace(built[a["name"]], files=files))
    raw = json.dumps(m).encode()
    head = _member(MANIFEST, raw) + bytes(_header(b"onnx/model.onnx", declared, b"0"))
    return _write_huge(path, head, declared, real)


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counting written bytes needs Linux /proc")
def test_a_pack_declaring_more_than_its_ratio_is_refused_before_a_byte_is_written(small_bundle, tmp_path):
    bomb = _declaring(small_bundle, tmp_path / "bomb.tar.zst", 4 << 30, 64 << 20)
    size = bomb.stat().st_size
    assert size < 4 << 20 and pack_mod.unpack_limit(size) < 4 << 30
    before = _written()
    with pytest.raises(BundleError, match=r"declares \d+ bytes unpacked from a \d+-byte pack") as e:
        unpack(bomb, tmp_path / "into")
    assert _written() - before < 1 << 20, "bytes were written before the refusal"
    assert "\n" not in str(e.value) and pack_mod.ENV_MAX_RATIO in str(e.value)
    assert not (tmp_path / "into").exists() and not list(tmp_path.glob(".into.*"))
    with pytest.raises(BundleError, match="declares"):
        read_pack_manifest(bomb)           # load(bundle=PACK) and fetch's choice of pack refuse it as early


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counting written bytes needs Linux /proc")
def test_a_pack_within_its_ratio_but_lying_writes_at_most_its_limit(small_bundle, tmp_path, monkeypatch):
    """The worst a pack can make unpacking write: its limit, then the member's sha256 refuses it."""
    lying = _declaring(small_bundle, tmp_path / "lying.tar.zst", 48 << 20, 48 << 20)
    limit = pack_mod.unpack_limit(lying.stat().st_size)
    assert limit == pack_mod.MIN_UNPACK_BYTES    # a tiny pack: the floor
    before = _written()
    with pytest.raises(BundleError, match="has sha256"):
        unpack(lying, tmp_path / "into")
    assert _written() - before <= limit + (1 << 20)
    assert not list(tmp_path.glob(".into.*"))
    # the setting lowers (or raises) the ratio, and a bad value is one line naming it
    monkeypatch.setattr(pack_mod, "MIN_UNPACK_BYTES", 1 << 20)
    with pytest.raises(BundleError, match=r"declares \d+ bytes unpacked"):
        unpack(lying, tmp_path / "into")
    monkeypatch.setenv(pack_mod.ENV_MAX_RATIO, "1e9")
    with pytest.raises(BundleError, match="has sha256"):
        unpack(lying, tmp_path / "into")
    monkeypatch.setenv(pack_mod.ENV_MAX_RATIO, "lots")
    with pytest.raises(BundleError, match="invalid LAYA_AOT_UNPACK_MAX_RATIO='lots': use a number >= 1"):
        unpack(lying, tmp_path / "into")


def test_a_real_pack_is_far_inside_its_ratio(small_bundle, small_pack):
    m = read_pack_manifest(small_pack)
    unpacked = sum(r.size for a in m.artifacts for r in a.files.values())
    assert unpacked / small_pack.stat().st_size < pack_mod.MAX_RATIO / 8


# --- a killed pack --------------------------------------------------------------------------------------------

_SLOW_PACK = """
import sys, time
from laya_aot.distribution import pack as p
read = p._Hashing.read
def slow(self, n=-1):
    time.sleep(0.05)
    return read(self, n)
p._Hashing.read = slow
p.pack(sys.argv[1], sys.argv[2])
"""


def test_a_killed_pack_leaves_what_the_next_pack_removes(small_bundle, tmp_path):
    file = tmp_path / "demo.tar.zst"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_PACK, str(small_bundle), str(file)],
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    deadline = time.time() + 60
    partial = []
    while time.time() < deadline and not partial:
        partial = [p for p in tmp_path.glob(".demo.tar.zst.partial-*") if (p / "demo.tar.zst").exists()]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial and partial[0].exists() and not file.exists()
    # a pack written by an older laya-aot, killed: `.FILE.partial-PID`, a file; and a user's file named like one
    older = tmp_path / (".demo.tar.zst.partial-%d" % proc.pid)
    whole = pack(small_bundle, tmp_path / "whole.tar.zst").path.read_bytes()
    older.write_bytes(whole[:len(whole) // 2])
    mine = tmp_path / ".demo.tar.zst.partial-1"
    mine.write_text("my notes")
    huge = tmp_path / (".demo.tar.zst.partial-%d" % 10 ** 30)   # no process has that pid
    huge.write_bytes(whole)
    info = pack(small_bundle, file)
    assert read_pack_manifest(info.path).artifacts
    assert not partial[0].exists() and older.exists() and mine.read_text() == "my notes" and huge.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".demo.tar.zst.partial-1", older.name, huge.name,
                                                                 "demo.tar.zst", "whole.tar.zst"])


def test_pack_leaves_a_users_pack_named_like_an_older_leftover_and_names_it(small_pack, small_bundle, tmp_path,
                                                                            caplog):
    """A user's copy of a pack under `.FILE.partial-PID` (PID gone) cannot be told from an older laya-aot's
    leftover by its content: it stays, byte for byte, and one warning names it."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    copy = tmp_path / (".demo.tar.zst.partial-%d" % proc.pid)
    shutil.copyfile(small_pack, copy)
    with caplog.at_level(logging.WARNING, logger="laya_aot.distribution.pack"):
        pack(small_bundle, tmp_path / "demo.tar.zst")
    assert copy.read_bytes() == small_pack.read_bytes()
    named = [r for r in caplog.records if r.levelno == logging.WARNING and str(copy) in r.getMessage()]
    assert len(named) == 1 and "you may remove it" in named[0].getMessage()


def test_a_pack_interrupted_in_this_process_leaves_nothing(small_bundle, tmp_path, monkeypatch):
    def interrupted(self, n=-1):
        raise KeyboardInterrupt

    monkeypatch.setattr(pack_mod._Hashing, "read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack(small_bundle, tmp_path / "x.tar.zst")
    assert list(tmp_path.iterdir()) == []


def test_unpacked_bundles_load(small_bundle, small_pack, demo_ckpt, tmp_path):
    """What the new proof accepts is what the loader serves: an unpacked pack replaces itself and loads."""
    out = tmp_path / "b"
    assert _run(["unpack", small_pack, out])[0] == 0
    assert _run(["unpack", small_pack, out])[0] == 0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya_aot.load(str(demo_ckpt), bundle=str(out), device="cpu")
    assert agent.backend.startswith("aot:")


# --- one writer at a time -------------------------------------------------------------------------------------

_WRITER = """
import os, sys
from pathlib import Path
from laya_aot import staging
out, how = Path(sys.argv[1]), sys.argv[2]
try:
    if how == "file":
        with staging.staged_file(out) as f:
            f.write_bytes(b"second")
    elif how == "killed":
        held = staging.writing(out)
        held.__enter__()
        os._exit(0)  # gone holding the lock, as a command killed with SIGKILL is
    else:
        with staging.staged(out) as tmp:
            (tmp / "f").write_text("second")
except staging.OutputBusy as e:
    print(e)
    sys.exit(3)
"""


def _writer(out: Path, how: str = "dir") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WRITER, str(out), how], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), timeout=120)


def test_a_second_writer_of_an_output_is_refused_while_the_first_writes(tmp_path):
    """Two commands writing one output at once cannot both publish: the second is refused at once, naming the
    first, and touches nothing; once the first is done, or gone without releasing (SIGKILL), the next may write."""
    out = tmp_path / "out"
    with staging.staged(out) as tmp:
        (tmp / "f").write_text("first")
        for how in ("dir", "file"):
            r = _writer(out, how)
            assert r.returncode == 3, r.stderr
            assert r.stdout.strip() == ("%s is being written by another laya-aot command (process %d); wait for it "
                                        "to finish, or write to another output" % (out, os.getpid()))
        assert not out.exists() and len(list(tmp_path.glob(".out.partial-*"))) == 1   # only this one's staging
    assert (out / "f").read_text() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert _writer(out, "killed").returncode == 0 and (tmp_path / ".out.lock").exists()
    r = _writer(out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "f").read_text() == "second" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("what", ["a user's file", "a hard link to a user's file", "a directory"])
def test_a_users_file_at_the_locks_name_is_never_emptied_nor_removed(tmp_path, what):
    """`writing` locks `out` with `.out.lock`, which it empties, fills with its process id and removes: a user's
    file of that name was deleted, and one hard-linked to another file emptied that file. Now only a lock it could
    have made (new, or a killed command's holding a process id) is used; anything else is refused untouched."""
    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    thesis = tmp_path / "thesis.txt"
    thesis.write_text("my thesis")
    if what == "a user's file":
        lock.write_text("my notes")
    elif what == "a hard link to a user's file":
        os.link(thesis, lock)
    else:
        lock.mkdir()
    with pytest.raises(staging.OutputRefused, match=r"\.out\.lock is .*nothing was touched; rename or remove it"):
        with staging.staged(out) as tmp:
            (tmp / "f").write_text("never")
    assert thesis.read_text() == "my thesis" and not out.exists() and os.path.lexists(lock)
    if what == "a user's file":
        assert lock.read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".out.lock", "thesis.txt"])

