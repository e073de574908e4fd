"""The runtime loader: selection, trust checks, the laya Agent backend, threads, crashing artifacts."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import laya_aot
from laya_aot.bundle_format import read_manifest
from laya_aot.files import write_json_atomic
from laya_aot.manifest import MANIFEST
from laya_aot.runtime.loader import NoArtifactError
from tests.questions import assert_same_answers, question_suite, state_text


@pytest.fixture(scope="module")
def eager(demo_ckpt):
    import laya

    return laya.load(str(demo_ckpt), device="cpu")


@pytest.fixture(scope="module")
def aot(demo_ckpt, demo_bundle):
    return laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", prefer="aoti")


def test_default_picks_a_bundle_artifact(demo_ckpt, demo_bundle):
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu")
    assert agent.backend in ("aot:aoti", "aot:onnx")      # ranked by the latency the build measured
    assert agent.backend_object.artifact.status == "verified"


def test_aoti_is_chosen_and_described(aot):
    assert aot.backend == "aot:aoti"
    bo = aot.backend_object
    assert bo.artifact.kind == "aoti" and bo.variant.startswith("torch")
    assert bo.verify.passed and bo.verify.max_abs_option_prob <= 1e-4
    assert "artifact_calls" not in bo.stats  # the load-time smoke check is not counted as traffic


def test_fifty_questions_of_all_types_answer_as_laya_eager(aot, eager):
    qs = question_suite()
    rng = np.random.default_rng(9)
    states = [state_text(rng, n) for n in (3, 40, 120)]
    before = aot.backend_object.stats.get("artifact_calls", 0)
    for got, ref in zip(aot.predict_batch(states, qs), eager.predict_batch(states, qs)):
        assert_same_answers(got["answers"], ref["answers"])
    assert aot.backend_object.stats["artifact_calls"] > before
    assert aot.backend_object.stats["host_path"]["heads_cached"] > 0  # the default host path served this


def test_long_states_over_several_windows(aot, eager):
    qs = {k: v for k, v in list(question_suite().items())[::6]}
    long_state = state_text(np.random.default_rng(3), 900)   # far past the 256-token context: several windows
    got, ref = aot.predict_long(long_state, qs), eager.predict_long(long_state, qs)
    assert_same_answers(got["answers"], ref["answers"])


def test_system_one_and_decide_run_unchanged(aot, eager):
    q = {"ok": {"type": "noul", "instructions": "The request is valid."}}
    g, r = aot.system_one("please reset my password", q), eager.system_one("please reset my password", q)
    assert_same_answers(g["answers"], r["answers"])


def test_rows_beyond_the_export_are_chunked(aot, eager):
    states = [state_text(np.random.default_rng(i), 5 + i % 7) for i in range(70)]   # 70 rows > max_rows 64
    q = {"t": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "tech", "account"]}}
    chunks = aot.backend_object.stats.get("chunks", 0)
    for got, ref in zip(aot.predict_batch(states, q, batch_size=70), eager.predict_batch(states, q, batch_size=70)):
        assert_same_answers(got["answers"], ref["answers"])
    assert aot.backend_object.stats["chunks"] - chunks >= 2


def _laya_forwards(monkeypatch) -> list:
    """Counts the calls laya's own `_infer` runs (each enters laya's autocast context once)."""
    import laya.agent

    entered = []
    stock = laya.agent._amp_context

    def counted(*args, **kwargs):
        entered.append(args)
        return stock(*args, **kwargs)
    monkeypatch.setattr(laya.agent, "_amp_context", counted)
    return entered


def test_the_backend_takes_layas_batch_on_the_host(aot, eager, monkeypatch):
    """The artifact gets laya's collated batch where laya made it, on the host (`AOTBackend.host_call`): laya's own
    `_infer`, which moves each input to the device apart, runs none of these calls, and the answers are laya's."""
    laya_runs = _laya_forwards(monkeypatch)
    qs = dict(list(question_suite().items())[::4])
    rng = np.random.default_rng(5)
    states = [state_text(rng, n) for n in (2, 30, 90)]
    before = aot.backend_object.stats.get("artifact_calls", 0)
    got = aot.predict_batch(states, qs)
    assert aot.backend_object.stats["artifact_calls"] > before and not laya_runs
    for answer, ref in zip(got, eager.predict_batch(states, qs)):
        assert_same_answers(answer["answers"], ref["answers"])
    assert laya_runs  # laya's eager agent's own calls are counted


def test_laya_runs_what_the_host_call_declines_or_fails(aot, eager, monkeypatch):
    """Near-ties re-run by laya's eager forward need its device and autocast, and a RuntimeError (running out of
    memory) is laya's to retry: both calls are laya's own `_infer`, with laya's answers."""
    laya_runs = _laya_forwards(monkeypatch)
    qs = dict(list(question_suite().items())[:3])
    state = ["the refund never came and the invoice is wrong"]
    ref = eager.predict_batch(state, qs)
    laya_runs.clear()
    bo = aot.backend_object
    monkeypatch.setattr(bo, "near_ties", "rows")
    assert bo.tie_margin is not None
    assert_same_answers(aot.predict_batch(state, qs)[0]["answers"], ref[0]["answers"])
    monkeypatch.setattr(bo, "near_ties", "off")

    def short_of_memory(b):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(bo, "host_call", short_of_memory)
    assert_same_answers(aot.predict_batch(state, qs)[0]["answers"], ref[0]["answers"])
    assert len(laya_runs) == 2  # the two calls, each laya's own


def test_prefer_onnx(demo_ckpt, demo_bundle, eager):
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", prefer="onnx", host_path=False)
    assert agent.backend == "aot:onnx"
    assert agent.backend_object.host_path is None and "host_path" not in agent.backend_object.stats
    qs = dict(list(question_suite().items())[::5])
    state = ["the invoice is wrong"]
    for got, ref in zip(agent.predict_batch(state, qs), eager.predict_batch(state, qs)):
        assert_same_answers(got["answers"], ref["answers"])


def test_a_token_past_the_embedding_is_refused_with_the_fix(demo_ckpt, demo_bundle, eager):
    """A tokenizer grown past the embedding (tokens added without resizing it) makes ids native code would index
    past its table with (ending the process); the backend refuses them with the cause and the fix, and serves
    on."""
    from laya_aot.runtime.backend import TokenIdError

    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu")
    ids = agent.backend_object.token_ids
    # the demo's tokenizer fits its embedding: ids are checked where it costs nothing (on the CPU), not on a device
    assert ids.rows == agent.model.encoder.config.vocab_size and not ids.on_device
    qs = dict(list(question_suite().items())[:1])
    state = ["the invoice is wrong and the refund never came"]
    ids.rows = 30  # as if the tokenizer had grown past the encoder's first 30 rows
    with pytest.raises(TokenIdError, match="past the encoder's 30 embedding rows.*resize_token_embeddings"):
        agent.predict_batch(state, qs)
    ids.rows = 1 << 30  # every id fits: the check passes and the artifact answers
    for got, ref in zip(agent.predict_batch(state, qs), eager.predict_batch(state, qs)):
        assert_same_answers(got["answers"], ref["answers"])


def test_embedding_rows_short_names_only_a_tokenizer_past_the_embedding():
    from types import SimpleNamespace

    from laya_aot import laya_internals as laya_api

    def agent(rows, tokens):
        return SimpleNamespace(model=SimpleNamespace(encoder=SimpleNamespace(config=SimpleNamespace(vocab_size=rows))),
                               tok=[None] * tokens)
    assert laya_api.embedding_rows_short(agent(100, 100)) is None
    assert laya_api.embedding_rows_short(agent(100, 60)) is None
    assert laya_api.embedding_rows_short(agent(100, 101)) == 100
    assert laya_api.embedding_rows_short(SimpleNamespace(model=SimpleNamespace(), tok=[None] * 5)) is None

    class Tok(list):   # a tokenizer inside the rows whose pad token (which laya pads with) is not
        pad_token_id = 100
    assert laya_api.embedding_rows_short(SimpleNamespace(model=agent(100, 1).model, tok=Tok([None] * 60))) == 100


def test_threads_give_the_serial_answers(aot):
    qs = list(question_suite().items())
    rng = np.random.default_rng(1)
    calls = []
    for i in range(25):
        n_q = 1 + i % 4
        calls.append(([state_text(rng, 4 + 13 * (i % 9)) for _ in range(1 + i % 3)], dict(qs[i: i + n_q])))
    serial = [aot.predict_batch(s, q) for s, q in calls]
    results = {}
    errors = []

    def worker(t):
        try:
            for j in range(25):
                k = (j + 3 * t) % 25
                results[(t, j)] = (k, aot.predict_batch(*calls[k]))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(results) == 200
    for k, res in results.values():
        assert [r["answers"] for r in res] == [r["answers"] for r in serial[k]]


# ---------------------------------------------------------------------------- refusing bad bundles
@pytest.fixture
def no_native_load(monkeypatch):
    """Fail the test if anything tries to load native code from the bundle or probe it."""
    import torch._inductor.package as pkg

    from laya_aot.kinds import aoti as runners

    calls = []

    def forbidden(*a, **k):  # recorded too: a call from the loader's early-probe thread must fail the test
        calls.append(a)
        raise AssertionError("native code was loaded from a bundle that should have been refused")
    monkeypatch.setattr(pkg, "load_package", forbidden)
    monkeypatch.setattr(runners, "load_aoti_package", forbidden)
    monkeypatch.setattr(runners, "load_aoti", forbidden)
    monkeypatch.setattr(subprocess, "run", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    yield
    assert not calls, "native code was loaded or probed: %r" % (calls[:1],)


def _load_expect_eager(ckpt, bundle, match, **kw):
    with pytest.warns(RuntimeWarning, match=match):
        agent = laya_aot.load(str(ckpt), bundle=str(bundle), device="cpu", **kw)
    assert agent.backend == "eager"
    with pytest.raises(NoArtifactError, match=match):
        laya_aot.load(str(ckpt), bundle=str(bundle), device="cpu", strict=True, **kw)
    return agent


def _native_files(bundle: Path):
    """Every AOTInductor package or unpacked library of the bundle (both kinds of file a CPU build ships)."""
    found = sorted(bundle.glob("aoti-cpu*/model.pt2")) + sorted(bundle.glob("aoti-cpu*/model.so"))
    assert len(found) == 2, found
    return found


def test_flipped_byte_is_refused(bundle_copy, demo_ckpt, no_native_load):
    for so in _native_files(bundle_copy):
        data = bytearray(so.read_bytes())
        data[len(data) // 2] ^= 0xFF
        so.write_bytes(bytes(data))
    agent = _load_expect_eager(demo_ckpt, bundle_copy, "aoti-cpu: sha256", prefer="aoti")
    assert any("changed after the build" in why for _, why in agent.backend_object.rejected)


def test_a_byte_flipped_after_a_good_load_is_refused_despite_the_digest_cache(bundle_copy, demo_ckpt, monkeypatch):
    import os

    laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", prefer="aoti")  # digests now cached
    for so in _native_files(bundle_copy):
        st = so.stat()
        data = bytearray(so.read_bytes())
        data[len(data) // 3] ^= 0xFF
        with open(so, "r+b") as f:  # in place: same inode and size
            f.write(bytes(data))
        os.utime(so, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime: only ctime tells
    agent = _load_expect_eager(demo_ckpt, bundle_copy, "aoti-cpu: sha256", prefer="aoti")
    assert any("changed after the build" in why for _, why in agent.backend_object.rejected)


def test_bundle_from_another_checkpoint_is_refused(demo_bundle, alt_ckpt, no_native_load):
    _load_expect_eager(alt_ckpt, demo_bundle, "built from another checkpoint")


def test_newer_manifest_schema_is_refused(bundle_copy, demo_ckpt, no_native_load):
    m = json.loads((bundle_copy / MANIFEST).read_text())
    m["schema_version"] = 99
    write_json_atomic(bundle_copy / MANIFEST, m)
    _load_expect_eager(demo_ckpt, bundle_copy, "newer than this laya-aot understands")


def test_missing_file_is_refused(bundle_copy, demo_ckpt, no_native_load):
    (bundle_copy / "aoti-cpu" / "constants.json").unlink()
    (bundle_copy / "aoti-cpu-frozen" / "model.so").unlink()
    (bundle_copy / "onnx" / "model.onnx").unlink()
    _load_expect_eager(demo_ckpt, bundle_copy, "missing|sha256")


def test_missing_manifest_is_refused(bundle_copy, demo_ckpt, no_native_load):
    (bundle_copy / MANIFEST).unlink()
    _load_expect_eager(demo_ckpt, bundle_copy, "not a complete laya-aot bundle")


def _edit_needs(bundle: Path, **needs):
    m = json.loads((bundle / MANIFEST).read_text())
    for a in m["artifacts"]:
        if a["kind"] == "aoti":
            a["needs"].update(needs)
    write_json_atomic(bundle / MANIFEST, m)


def test_artifact_for_another_torch_is_refused(bundle_copy, demo_ckpt, no_native_load):
    _edit_needs(bundle_copy, torch="2.99.0")
    _load_expect_eager(demo_ckpt, bundle_copy, "built for torch 2.99.0", prefer="aoti")


def test_artifact_for_a_gpu_architecture_is_refused(bundle_copy, demo_ckpt, no_native_load):
    m = json.loads((bundle_copy / MANIFEST).read_text())
    for a in m["artifacts"]:
        if a["kind"] == "aoti":
            a["device"] = "cuda"
            a["needs"].update(device="cuda", gpu_arch="sm_90", cuda="13.0")
    write_json_atomic(bundle_copy / MANIFEST, m)
    agent = _load_expect_eager(demo_ckpt, bundle_copy, "aoti-cpu: built for cuda", prefer="aoti")
    assert agent.backend_object.rejected


# ------------------------------------------------------------------------- an artifact that crashes
ABORT_C = '#include <stdlib.h>\n__attribute__((constructor)) static void boom(void) { abort(); }\n'


def _crashing_bundle(bundle: Path, tmp: Path) -> None:
    """Replace the AOTInductor package's shared library by one that calls abort() when loaded."""
    src = tmp / "boom.c"
    src.write_text(ABORT_C)
    lib = tmp / "boom.so"
    subprocess.check_call(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)])
    pkg = bundle / "aoti-cpu" / "model.pt2"
    old = zipfile.ZipFile(pkg)
    out = tmp / "model.pt2"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in old.infolist():
            data = lib.read_bytes() if info.filename.endswith(".so") else old.read(info.filename)
            z.writestr(info, data)
    old.close()
    shutil.copy(out, pkg)
    from laya_aot import kinds
    from laya_aot.bundle_format import read_bundle, record_files, write_manifest

    m = read_bundle(bundle, kinds.NAMES)
    for a in m.artifacts:
        if a.kind == "aoti":
            record_files(bundle, a)   # a genuine, correctly hashed (file by file), crashing artifact
            if a.name == "aoti-cpu":
                a.latency_ms = {"cpu": {"1x128x4": 1e-3}}     # ranked first, so it is tried first
    write_manifest(bundle, m)


def test_crashing_artifact_is_probed_skipped_and_remembered(bundle_copy, demo_ckpt, tmp_path, monkeypatch):
    _crashing_bundle(bundle_copy, tmp_path)
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu")
    # this process survived; the next artifact serves
    assert agent.backend.startswith("aot:") and agent.backend_object.artifact.name != "aoti-cpu"
    reasons = dict(agent.backend_object.rejected)
    assert agent.backend_object.load_stats["agent_load_s"] > 0
    assert reasons["aoti-cpu"] == "loading it crashed a probe process: SIGABRT"
    r = agent.predict_batch(["hello"], {"q": {"type": "noul", "instructions": "ok?"}})
    assert 0 <= r[0]["answers"]["q"]["noul"] <= 1
    # the verdict is reused: no child process runs on the next start
    def forbidden(*a, **k):
        raise AssertionError("the probe ran again")
    monkeypatch.setattr(subprocess, "run", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    again = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu")
    assert dict(again.backend_object.rejected)["aoti-cpu"] == "loading it crashed a probe process: SIGABRT"
    assert again.backend_object.artifact.name == agent.backend_object.artifact.name


def test_first_start_probes_while_laya_loads(other_facts_bundle, demo_ckpt, tmp_path, monkeypatch):
    # a machine that never saw the bundle, unlike the build's: the probe child starts before laya.load and is
    # collected after
    demo_bundle = other_facts_bundle
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "fresh-cache"))
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", prefer="aoti")
    stats = agent.backend_object.load_stats
    assert stats["probe"] == "ran" and stats["probe_overlapped_laya_load"] is True
    # the verdict it wrote is the one the next start reads
    again = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", prefer="aoti")
    assert again.backend_object.load_stats["probe"] == "cached"
    assert again.backend_object.artifact.name == agent.backend_object.artifact.name
    # the start that ran the probe child is not a start cost the next ones compare with; a later start is
    name = agent.backend_object.artifact.name
    assert name not in again.backend_object.load_stats["start_costs_here_s"]
    third = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", prefer="aoti")
    stats = again.backend_object.load_stats
    assert third.backend_object.load_stats["start_costs_here_s"][name] == round(stats["agent_load_s"] +
                                                                                stats["select_s"], 3)


def test_mismatch_tells_a_bundle_of_this_checkpoint_from_others(demo_bundle, demo_ckpt, alt_ckpt):
    from laya_aot import kinds
    from laya_aot.bundle_format import read_bundle
    from laya_aot.checkpoint import mismatch

    manifest = read_bundle(demo_bundle, kinds.NAMES)
    assert mismatch(manifest, demo_ckpt) is None
    assert mismatch(manifest.checkpoint.fingerprint, demo_ckpt) is None  # the recorded fingerprint alone
    why = mismatch(manifest, alt_ckpt)
    assert "built from another checkpoint than %s" % alt_ckpt in why and "differing: " in why


# ------------------------------------------------------------------ the load-time smoke check, the probe
def test_smoke_check_compares_with_the_builds_reference_not_eager(demo_ckpt, demo_bundle, monkeypatch):
    from laya_aot.runtime.backend import AOTBackend

    assert read_manifest(demo_bundle)["smoke"]["reference"]
    def no_eager(*a, **k):
        raise AssertionError("the smoke check ran the eager forward")
    monkeypatch.setattr(AOTBackend, "stock_forward", no_eager)
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", prefer="aoti", strict=True)
    assert agent.backend == "aot:aoti" and agent.backend_object.load_stats["smoke_check_s"] >= 0


def test_an_artifact_that_disagrees_with_the_builds_reference_is_refused(bundle_copy, demo_ckpt):
    m = json.loads((bundle_copy / MANIFEST).read_text())
    logits = m["smoke"]["reference"][0]
    m["smoke"]["reference"][0] = [row[::-1] for row in logits]   # what a wrongly loaded artifact would answer
    _rehash_smoke(m)   # a record whose hash matches: the check itself must catch the disagreement
    write_json_atomic(bundle_copy / MANIFEST, m)
    agent = _load_expect_eager(demo_ckpt, bundle_copy, "disagrees with the build's eager fp32 reference",
                               prefer="aoti")
    reasons = dict(agent.backend_object.rejected)
    assert {n for n in reasons if n.startswith("aoti")} == {"aoti-cpu", "aoti-cpu-frozen"}
    assert all("disagrees" in why for n, why in reasons.items() if n.startswith("aoti"))


def _rehash_smoke(m):
    from laya_aot.manifest import SmokeRecord, smoke_digest

    rec = m["smoke"]
    rec["sha256"] = smoke_digest(SmokeRecord(rec["inputs"], rec["input_dtypes"], rec["reference"]))


def test_a_smoke_record_changed_after_the_build_is_not_run(bundle_copy, demo_ckpt, monkeypatch):
    m = json.loads((bundle_copy / MANIFEST).read_text())
    assert m["smoke"]["sha256"]
    m["smoke"]["reference"][0][0][0] += 1.0       # damage, with the hash left as the build wrote it
    write_json_atomic(bundle_copy / MANIFEST, m)
    fed = _watch_records(monkeypatch)
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", prefer="aoti", strict=True)
    assert agent.backend == "aot:aoti" and not fed   # checked against eager on a batch made here instead


def _watch_records(monkeypatch):
    from laya_aot import verification

    fed, real = [], verification.smoke_from_record
    monkeypatch.setattr(verification, "smoke_from_record", lambda r: fed.append(r) or real(r))
    return fed


@pytest.mark.parametrize("where,value,why", [
    (("inputs", 0, 0, 0), 10 ** 6, "not below the checkpoint's vocabulary"),      # an id past the embedding
    (("inputs", 0, 0, 0), -1, "token ids >= 0"),
    (("inputs", 2, 0, 0), 10 ** 4, "positions inside the"),                       # a marker past the tokens
    (("inputs", 4, 0), 7, "question types"),
    (("input_dtypes", 3), "float32", "smoke.input_dtypes"),
])
def test_a_smoke_record_that_would_crash_native_code_is_never_fed_to_it(bundle_copy, demo_ckpt, where, value, why,
                                                                       monkeypatch):
    m = json.loads((bundle_copy / MANIFEST).read_text())
    node = m["smoke"]
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    _rehash_smoke(m)   # as a careful attacker would: the hash matches, the validation must refuse it
    write_json_atomic(bundle_copy / MANIFEST, m)
    fed = _watch_records(monkeypatch)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", prefer="aoti")
    if why == "not below the checkpoint's vocabulary":   # needs the checkpoint: the loader checks it, then uses eager's
        assert agent.backend == "aot:aoti"
    else:   # structure: the manifest is refused as a whole, naming the field
        assert agent.backend == "eager"
        assert why in dict(agent.backend_object.rejected)["bundle"]
    assert not fed


def test_a_bundle_without_a_smoke_reference_is_checked_against_eager(bundle_copy, demo_ckpt):
    m = json.loads((bundle_copy / MANIFEST).read_text())
    del m["smoke"]
    write_json_atomic(bundle_copy / MANIFEST, m)
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", prefer="aoti", strict=True)
    assert agent.backend == "aot:aoti"


def test_probe_stand_in_weights_have_the_checkpoints_shapes(demo_ckpt, demo_bundle):
    from safetensors.torch import load_file

    from laya_aot.kinds.aoti import CONSTANTS as AOTI_CONSTANTS
    from laya_aot.kinds.aoti import synthetic_constants

    art = demo_bundle / "aoti-cpu"
    fake = synthetic_constants(art, demo_ckpt, "cpu")
    real = load_file(str(demo_ckpt / "model.safetensors"))
    spec = json.loads((art / AOTI_CONSTANTS).read_text())["constants"]
    wanted = {s["key"]: s["dtype"] for s in spec.values() if s["source"] == "model"}
    assert fake.keys() == wanted.keys() and wanted
    for key, t in fake.items():
        assert t.shape == real[key].shape and t.dtype == getattr(torch, wanted[key])


@pytest.fixture
def finetuned_ckpt(demo_ckpt, tmp_path, monkeypatch) -> Path:
    """A checkpoint with the build's configs and tokenizer but other weights (a fine-tune), loaded with an empty
    cache; the demo's weights (0.7 MB in fp16) count as a large file here, as a real checkpoint's would."""
    import functools

    from safetensors.torch import load_file, save_file

    from laya_aot import checkpoint as ckpt_mod

    other = tmp_path / "finetuned"
    shutil.copytree(demo_ckpt, other)
    w = load_file(str(other / "model.safetensors"))
    key = sorted(w)[0]
    w[key] = w[key] + 0.5
    save_file(w, str(other / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "fresh-cache"))
    monkeypatch.setattr(ckpt_mod, "differing_small_files", functools.partial(ckpt_mod.differing_small_files,
                                                                             limit_bytes=1 << 18))
    return other


def test_early_probe_of_a_same_sized_foreign_checkpoint_is_killed_and_not_recorded(other_facts_bundle, finetuned_ckpt,
                                                                                   tmp_path, probe_starts):
    """On a machine unlike the build's: the probe child may start before the weights' digest is known; the
    mismatch refuses the bundle, and no verdict is cached for it."""
    started = probe_starts
    _load_expect_eager(finetuned_ckpt, other_facts_bundle, "built from another checkpoint", prefer="aoti")
    assert started and all(p.proc.poll() is not None for p in started)   # started early, then ended
    assert not list((tmp_path / "fresh-cache" / "probes").glob("*.json"))


def test_a_foreign_checkpoint_is_refused_though_its_artifact_loaded_before_the_digest(demo_bundle, finetuned_ckpt,
                                                                                     monkeypatch):
    """On a machine like the build's no child runs, and the head start loads the artifact with the weights while
    the checkpoint's digest is still being computed: the mismatch still refuses the bundle, and what was loaded
    is dropped, never installed."""
    from laya_aot import checkpoint as ckpt_mod
    from laya_aot.runtime import head_start

    loaded, load_done = [], threading.Event()
    real_load, real_mismatch = head_start.HeadStart._load, ckpt_mod.mismatch

    def recording_load(self, *a, **k):
        try:
            real_load(self, *a, **k)
            loaded.append(self._runner is not None)
        finally:
            load_done.set()

    def late_mismatch(*a, **k):
        # a large checkpoint's digest ends after the load; this small one's may end first (the load is then
        # skipped), so the order is fixed here, for the head start's digest and the loader's, not left to a race
        load_done.wait(timeout=120)
        return real_mismatch(*a, **k)
    monkeypatch.setattr(head_start.HeadStart, "_load", recording_load)
    monkeypatch.setattr(ckpt_mod, "mismatch", late_mismatch)
    agent = _load_expect_eager(finetuned_ckpt, demo_bundle, "built from another checkpoint", prefer="aoti")
    assert loaded[:1] == [True] and agent.backend == "eager"   # the first start loaded it (the strict one need not)


def test_an_artifact_verified_here_carries_the_bound_it_met_into_the_smoke_check(demo_ckpt, demo_bundle, tmp_path,
                                                                                 monkeypatch):
    """What the loader does with a cross-compiled TileLang artifact on its first GPU, shown with the ONNX
    artifact on the CPU: verification here yields the bound, the smoke check applies it, and a second
    start reads the same verdict and bound from the cache."""
    import dataclasses

    import laya

    from laya_aot import kinds
    from laya_aot.bundle_format import read_bundle
    from laya_aot.manifest import VerifyResult
    from laya_aot.runtime import trial
    from laya_aot.runtime.backend import AOTBackend
    from laya_aot.variant import current_machine

    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    manifest = read_bundle(demo_bundle, kinds.NAMES)
    art = dataclasses.replace(manifest.artifact("onnx-fp32"), status="unverified",
                              verify=VerifyResult(False, "cross-compiled without its GPU"))
    agent = laya.load(str(demo_ckpt), device="cpu")
    runner = kinds.load(demo_bundle / art.path, art, kinds.LoadEnv(device="cpu"))
    stats = {}
    here = trial._verify_here(agent, agent.model, runner, art, manifest, current_machine("cpu"), stats)
    assert here.passed and here.tolerance == 1e-4 and "verify_here_s" in stats
    again = trial._verify_here(agent, agent.model, runner, art, manifest, current_machine("cpu"), {})
    assert again.passed and again.tolerance == here.tolerance           # from the cache
    art = dataclasses.replace(art, verify=here)
    backend = AOTBackend(agent, runner, art, 0)
    assert trial._smoke_check(agent, backend, art, manifest) is None
    unverified = dataclasses.replace(art, verify=VerifyResult(False, "cross-compiled without its GPU"))
    assert "no verified tolerance" in trial._smoke_check(agent, backend, unverified, manifest)
