"""The weights fingerprinted in pieces (`files.sha256_parts`): what a start checks a large checkpoint with."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from laya_aot import checkpoint, files
from laya_aot.manifest import Fingerprint


def _reference(data: bytes, part: int) -> str:
    """The digest as its docstring defines it, computed in one thread."""
    h = hashlib.sha256(b"laya-aot sha256-parts\0%d\0%d\0" % (len(data), part))
    for at in range(0, max(len(data), 1), part):
        h.update(hashlib.sha256(data[at:at + part]).digest())
    return h.hexdigest()


@pytest.mark.parametrize("size", [0, 1, 4096, 4097, 3 * 4096 + 11])
@pytest.mark.parametrize("workers", [1, 3, 8])
def test_sha256_parts_is_the_defined_digest_whatever_the_threads(tmp_path, size, workers):
    data = os.urandom(size)
    p = tmp_path / "w.bin"
    p.write_bytes(data)
    assert files.sha256_parts(p, part_bytes=4096, workers=workers) == _reference(data, 4096)


def test_sha256_parts_changes_with_any_byte_and_with_the_part_size(tmp_path):
    data = bytearray(os.urandom(5 * 1000 + 3))
    p = tmp_path / "w.bin"
    p.write_bytes(data)
    base = files.sha256_parts(p, part_bytes=1000)
    assert files.sha256_parts(p, part_bytes=999) != base   # the part size is bound in
    for at in (0, 999, 1000, 2500, len(data) - 1):         # the first, a part's last and first, the middle, the last
        changed = bytearray(data)
        changed[at] ^= 1
        p.write_bytes(changed)
        assert files.sha256_parts(p, part_bytes=1000) != base, at
    p.write_bytes(data + b"\0")                            # a longer file
    assert files.sha256_parts(p, part_bytes=1000) != base


@pytest.fixture
def big_ckpt(demo_ckpt, tmp_path, monkeypatch):
    """A copy of the demo checkpoint where its weights count as a large file."""
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    shutil.copytree(demo_ckpt, ckpt)
    monkeypatch.setattr(checkpoint, "LARGE_FILE_BYTES", (ckpt / "model.safetensors").stat().st_size)
    return ckpt


def _recorded(fp: dict) -> Fingerprint:
    return Fingerprint(fp["sha256"], fp["files"], fp["parts"], fp["part_bytes"])


def test_fingerprint_records_parts_of_large_files_only_and_keeps_the_combined_digest(big_ckpt):
    fp = checkpoint.fingerprint(big_ckpt)
    assert list(fp["parts"]) == ["model.safetensors"]
    assert fp["parts"]["model.safetensors"] == files.sha256_parts(big_ckpt / "model.safetensors")
    # the combined digest (what bundles, verdicts and packs are keyed by) is still the files' sha256s alone
    assert fp["sha256"] == checkpoint.combined_digest(fp["files"])
    assert fp["files"]["model.safetensors"] == files.sha256_file(big_ckpt / "model.safetensors")
    assert fp["part_bytes"] == files.PART_BYTES


def test_parts_recorded_in_another_part_size_are_checked_in_that_size(big_ckpt):
    """A bundle built by a laya-aot that hashed other parts still matches: the check uses the recorded size."""
    fp = checkpoint.fingerprint(big_ckpt)
    w = big_ckpt / "model.safetensors"
    other = Fingerprint(fp["sha256"], fp["files"], {"model.safetensors": files.sha256_parts(w, 1 << 20)}, 1 << 20)
    assert other.parts != fp["parts"] and checkpoint.mismatch(other, big_ckpt) is None
    assert "built from another checkpoint" in checkpoint.mismatch(
        Fingerprint(fp["sha256"], fp["files"], other.parts, files.PART_BYTES), big_ckpt)


def test_mismatch_checks_large_files_by_parts_without_their_sha256(big_ckpt, monkeypatch):
    recorded = _recorded(checkpoint.fingerprint(big_ckpt))
    shutil.rmtree(os.environ["LAYA_AOT_CACHE_DIR"])         # a machine that never saw the checkpoint
    hashed = []
    real = files.sha256_file
    monkeypatch.setattr(files, "sha256_file", lambda p: hashed.append(os.path.basename(p)) or real(p))
    assert checkpoint.mismatch(recorded, big_ckpt) is None
    assert "model.safetensors" not in hashed and "rl_agent_config.json" in hashed


def test_mismatch_by_parts_names_a_changed_weights_file(big_ckpt):
    recorded = _recorded(checkpoint.fingerprint(big_ckpt))
    w = big_ckpt / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1                                           # one bit of the last tensor
    w.write_bytes(data)
    why = checkpoint.mismatch(recorded, big_ckpt)
    assert why is not None and "built from another checkpoint" in why and "differing: model.safetensors" in why


def test_mismatch_refuses_a_recorded_parts_digest_that_is_not_the_files(big_ckpt):
    """A manifest whose parts digest was edited is refused even where every sha256 still matches: the loader
    trusts only what it checked."""
    fp = checkpoint.fingerprint(big_ckpt)
    edited = Fingerprint(fp["sha256"], fp["files"], {"model.safetensors": "0" * 64}, fp["part_bytes"])
    assert "built from another checkpoint" in checkpoint.mismatch(edited, big_ckpt)


def test_a_record_whose_combined_digest_is_not_its_files_is_refused(big_ckpt):
    """Verdicts and packs are keyed by the combined digest: a record whose combined digest was edited is another
    checkpoint's, even where every file matches its recorded digest."""
    fp = checkpoint.fingerprint(big_ckpt)
    for parts in (fp["parts"], {}):
        edited = Fingerprint("0" * 64, fp["files"], parts, fp["part_bytes"])
        why = checkpoint.mismatch(edited, big_ckpt)
        assert "built from another checkpoint" in why and "differing: the recorded combined digest" in why


def test_mismatch_of_a_fingerprint_without_parts_checks_sha256(big_ckpt, monkeypatch):
    """Bundles built before parts were recorded: their weights are checked by sha256, as before."""
    fp = checkpoint.fingerprint(big_ckpt)
    old = Fingerprint(fp["sha256"], fp["files"])
    monkeypatch.setattr(files, "sha256_parts", lambda *a, **k: pytest.fail("parts computed for an old fingerprint"))
    shutil.rmtree(os.environ["LAYA_AOT_CACHE_DIR"])
    assert checkpoint.mismatch(old, big_ckpt) is None
    (big_ckpt / "tokenizer" / "extra.txt").write_text("x")  # a file more than the fingerprint lists
    assert "differing: tokenizer/extra.txt" in checkpoint.mismatch(old, big_ckpt)


def test_manifest_reads_parts_and_refuses_parts_of_unlisted_files(manifest):
    from laya_aot import kinds
    from laya_aot.manifest import Bundle, BundleError

    m = json.loads(json.dumps(manifest))
    m["checkpoint"]["fingerprint"].pop("parts", None)       # an older build's manifest
    assert Bundle.from_dict(m, kinds.BY_NAME).checkpoint.fingerprint.parts == {}
    m["checkpoint"]["fingerprint"].update(parts={"model.safetensors": "a" * 64}, part_bytes=32 << 20)
    fp = Bundle.from_dict(m, kinds.BY_NAME).checkpoint.fingerprint
    assert fp.parts == {"model.safetensors": "a" * 64} and fp.part_bytes == 32 << 20
    for bad in ({"other.bin": "a" * 64}, {"model.safetensors": "xyz"}):
        m["checkpoint"]["fingerprint"]["parts"] = bad
        with pytest.raises(BundleError, match="checkpoint.fingerprint.parts"):
            Bundle.from_dict(m, kinds.BY_NAME)
    m["checkpoint"]["fingerprint"]["parts"] = {"model.safetensors": "a" * 64}
    for bad in (0, 1, 2 << 30):   # none recorded, one-byte parts (a billion hashes), larger than any weights file
        m["checkpoint"]["fingerprint"]["part_bytes"] = bad
        with pytest.raises(BundleError, match="checkpoint.fingerprint.part_bytes"):
            Bundle.from_dict(m, kinds.BY_NAME)
