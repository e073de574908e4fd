"""The build pipeline: stages, manifest, hashes, numerical agreement, failures, interruption."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from laya_aot import kinds
from laya_aot.bundle_format import check_artifact_hash, read_bundle, read_manifest
from laya_aot.files import sha256_file
from laya_aot.manifest import MANIFEST, SCHEMA, SCHEMA_VERSION
from laya_aot.padding import Ranges
from laya_aot.pipeline import BuildError
from tests.conftest import build_bundle


def _by_name(manifest, name):
    (entry,) = [a for a in manifest["artifacts"] if a["name"] == name]
    return entry


def _hash_problem(bundle, name):
    return check_artifact_hash(bundle, read_bundle(bundle, kinds.NAMES).artifact(name))


def _by_kind(manifest, kind):
    (entry,) = [a for a in manifest["artifacts"] if a["kind"] == kind]
    return entry


def test_manifest_lists_every_stage_and_artifact(demo_bundle, demo_ckpt):
    m = read_manifest(demo_bundle)
    assert m["schema"] == SCHEMA and m["schema_version"] == SCHEMA_VERSION
    stages = {s["name"]: s for s in m["stages"]}
    assert list(stages) == ["load", "exported_program", "aoti", "onnx", "tilelang", "inductor_cache", "verify"]
    for name in ("load", "exported_program", "aoti", "onnx", "verify"):
        assert stages[name]["status"] == "ok" and stages[name]["seconds"] >= 0, stages[name]
    assert stages["tilelang"]["status"] == "skipped" and "CUDA" in stages["tilelang"]["error"]
    assert m["checkpoint"]["fingerprint"]["files"]["model.safetensors"] == sha256_file(demo_ckpt / "model.safetensors")
    assert m["tolerance"]["fp32"] == 1e-4
    names = {a["name"] for a in m["artifacts"]}
    # the frozen package: conftest.demo_bundle turns it on; the portable program: export.ship_program
    assert names == {"aoti-cpu", "aoti-cpu-frozen", "onnx-fp32"}
    for a in m["artifacts"]:
        assert a["status"] == "verified", a
        assert _hash_problem(demo_bundle, a["name"]) is None
        assert a["size"] > 0 and a["build_seconds"] > 0 and a["dtype"] == "fp32"
    aoti = _by_name(m, "aoti-cpu")
    assert aoti["variant"].startswith("torch%s%s-cxx11-cpu-" % tuple(torch.__version__.split(".")[:2]))
    assert aoti["needs"]["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
    assert aoti["latency_ms"]["cpu"]["1x128x4"] > 0
    # the example batch the export was traced at, recorded for each artifact of it: the CPU's default
    assert aoti["details"]["example"] == "3x48"
    assert not list(demo_bundle.parent.glob(".demo.partial-*"))


def test_the_verify_stage_says_where_its_time_went(demo_bundle):
    """A GPU build verifies for minutes: the stage's summary (kept in the manifest) names each artifact's verdict
    and the seconds of the eager reference, of each artifact and of the timing together."""
    import re

    (verify,) = [s for s in read_manifest(demo_bundle)["stages"] if s["name"] == "verify"]
    verdicts, phases = re.fullmatch(r"(.*) \((.*)\)", verify["summary"]).groups()
    names = [a["name"] for a in read_manifest(demo_bundle)["artifacts"] if a["status"] == "verified"]
    assert sorted(v.split()[0] for v in verdicts.split(", ")) == sorted(names)
    spent = dict(re.fullmatch(r"(.+) (\d+\.\d) s", p).groups() for p in phases.split(", "))
    assert list(spent)[:2] == ["eager timing", "fp32 reference"] and list(spent)[-1] == "timing together"
    assert set(names) <= set(spent)
    # each part is shown to 0.1 s, so their sum may pass the stage's time by half of that per part; a part counted
    # twice, or overlapping another, passes it by whole seconds
    assert sum(map(float, spent.values())) <= verify["seconds"] + 0.05 * len(spent) + 1e-6


def test_export_ranges_declare_tokens_as_multiples_of_16(demo_bundle):
    r = Ranges.from_dict(read_manifest(demo_bundle)["ranges"])
    assert r.token_multiple == 16 and r.min_tokens % 16 == 0 and r.max_tokens == 256
    assert r.min_rows == 1 and r.max_rows == 64 and r.min_markers == 2 and r.max_markers == 64


def test_the_portable_program_ships_only_when_asked(demo_bundle, small_bundle):
    """The program holds a copy of every weight and no runtime reads it: a default build leaves it out and says so;
    `export.ship_program=true` (conftest.SMALL) ships it, a file torch loads back, verified like the rest."""
    m = read_manifest(demo_bundle)
    (export,) = [s for s in m["stages"] if s["name"] == "exported_program"]
    assert "exported_program-fp32 not shipped: export.ship_program=false" in export["summary"], export["summary"]
    assert not (demo_bundle / "exported_program").exists()
    assert not any(a["kind"] == "exported_program" for a in m["artifacts"])
    small = read_manifest(small_bundle)
    assert _by_name(small, "exported_program-fp32")["status"] == "verified"
    ep = torch.export.load(str(small_bundle / "exported_program" / "fp32.pt2"))
    assert ep.module() is not None


def test_aoti_package_carries_no_weights(demo_bundle, demo_ckpt):
    from safetensors import safe_open

    aoti = _by_name(read_manifest(demo_bundle), "aoti-cpu")
    spec = json.loads((demo_bundle / aoti["path"] / "constants.json").read_text())["constants"]
    with safe_open(str(demo_ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    from_ckpt = [s["key"] for s in spec.values() if s["source"] == "model"]
    assert len(from_ckpt) >= len(keys) - 2 and set(from_ckpt) <= keys
    names = zipfile.ZipFile(demo_bundle / aoti["path"] / "model.pt2").namelist()
    assert not [n for n in names if "constants" in n or n.endswith((".bin", ".pt"))], names


def test_frozen_cpu_package_carries_the_weights(demo_bundle, demo_ckpt):
    m = read_manifest(demo_bundle)
    frozen, plain = _by_name(m, "aoti-cpu-frozen"), _by_name(m, "aoti-cpu")
    assert frozen["details"]["weights_inside"] and not plain["details"]["weights_inside"]
    assert frozen["status"] == "verified" and frozen["verify"]["max_abs_option_prob"] <= 1e-4
    weights = (demo_ckpt / "model.safetensors").stat().st_size
    assert frozen["details"]["package_bytes"] - plain["details"]["package_bytes"] > 0.5 * weights


def test_frozen_cpu_package_ships_its_library_unpacked(demo_bundle):
    """torch's package loader re-extracts the zip on every load; the frozen library is shipped out of it."""
    frozen = _by_name(read_manifest(demo_bundle), "aoti-cpu-frozen")
    shipped = sorted(p.name for p in (demo_bundle / frozen["path"]).iterdir())
    assert shipped == ["constants.json", "model.so"], shipped
    assert frozen["details"]["unpacked"]
    assert frozen["details"]["package_bytes"] == (demo_bundle / frozen["path"] / "model.so").stat().st_size


def test_onnx_model_is_checked_and_has_laya_input_names(demo_bundle):
    import onnx

    entry = _by_kind(read_manifest(demo_bundle), "onnx")
    model = onnx.load(str(demo_bundle / entry["path"]))
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask", "marker_pos", "marker_mask",
                                                   "qtype"]
    assert [o.name for o in model.graph.output] == ["logits", "act_logits"]


def test_numerical_agreement_on_every_case(demo_bundle):
    m = read_manifest(demo_bundle)
    for a in m["artifacts"]:
        v = a["verify"]
        assert set(v["cases"]) == {"one_row", "many_rows", "one_option", "max_markers", "odd_tokens", "longest",
                                   "max_rows", "padding_rows"}
        assert v["max_abs_option_prob"] <= 1e-4 and v["max_abs_action_prob"] <= 1e-4, a["name"]
        assert v["argmax_agreement"] == 1.0
        assert v["cases"]["padding_rows"]["rows"] == 3       # padding rows are excluded from the figures


def test_onnx_runs_in_laya_onnx_agent(demo_bundle, demo_ckpt):
    """laya's own ONNXAgent feeds unpadded token counts; the exported model must take them."""
    import laya
    from laya.onnx_agent import ONNXAgent

    qs = {"team": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "technical"]},
          "ok": {"type": "noul", "instructions": "It works."}}
    states = ["The invoice is wrong.", "Everything crashed after the update, please help!!"]
    onnx_agent = ONNXAgent(str(demo_ckpt), onnx_path=str(demo_bundle / "onnx" / "model.onnx"))
    eager = laya.load(str(demo_ckpt), device="cpu")
    for got, ref in zip(onnx_agent.predict_batch(states, qs), eager.predict_batch(states, qs)):
        for qid in qs:
            g, r = got["answers"][qid], ref["answers"][qid]
            assert abs(g["answer_confidence"] - r["answer_confidence"]) < 1e-4


def test_second_shape_through_checkpoint_path(alt_bundle, alt_ckpt):
    m = read_manifest(alt_bundle)
    assert m["checkpoint"]["name"] == "alt" and m["checkpoint"]["max_len"] == 384
    assert m["ranges"]["max_tokens"] == 384
    assert {a["kind"] for a in m["artifacts"] if a["status"] == "verified"} == {"aoti", "onnx"}
    assert [a["name"] for a in m["artifacts"] if a["kind"] == "aoti"] == ["aoti-cpu"]   # no frozen one by default
    for a in m["artifacts"]:
        assert a["verify"]["max_abs_option_prob"] <= 1e-4


# the builds of the failure tests: one AOTInductor package (the frozen one is built the same way) and 8 rows,
# which is all a stage that fails or is left out needs; the demo bundle covers the full build
FAILURES = ["aoti.cpu_frozen=false", "export.max_rows=8"]


@pytest.mark.slow  # builds a bundle
def test_aoti_failure_is_recorded_and_the_build_goes_on(demo_ckpt, tmp_path, monkeypatch):
    import laya_aot.kinds.aoti as aoti

    def boom(*a, **k):
        raise RuntimeError("simulated inductor crash")
    monkeypatch.setattr(aoti, "package", boom)
    m = build_bundle(demo_ckpt, tmp_path / "b", *FAILURES)
    stage = next(s for s in m["stages"] if s["name"] == "aoti")
    assert stage["status"] == "failed" and "simulated inductor crash" in stage["error"]
    failed = [a for a in m["artifacts"] if a["kind"] == "aoti"]
    assert failed and failed[0]["status"] == "build_failed" and "simulated" in failed[0]["error"]
    assert _by_kind(read_manifest(tmp_path / "b"), "onnx")["status"] == "verified"


@pytest.fixture(scope="module")
def faulty_build(demo_ckpt, tmp_path_factory):
    """One build with a fault in each of two stages: the ONNX exporter raises, and torch cannot load the saved
    program back. The AOTInductor package (compiled from the program in memory) is left to verify; each of the
    two tests below checks what its fault leaves, from one AOTInductor compile instead of one each.
    (manifest, bundle, the messages logged at WARNING and above)."""
    import logging

    import laya_aot.kinds.onnx as onnx_export

    def no_opset(*a, **k):
        raise ValueError("no opset")

    def unreadable(*a, **k):  # what torch 2.11 says of the autocast regions it saved
        raise RuntimeError("SpecViolationError: Node.meta wrap_with_autocast_2 is missing val field")

    logged = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logged.append
    out = tmp_path_factory.mktemp("faults") / "b"
    logging.getLogger().addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(onnx_export, "export_onnx", no_opset)
            mp.setattr(torch.export, "load", unreadable)
            m = build_bundle(demo_ckpt, out, *FAILURES, "export.ship_program=true")  # asked for, cannot ship
    finally:
        logging.getLogger().removeHandler(handler)
    return m, out, [r.getMessage() for r in logged]


def test_onnx_failure_is_recorded_and_the_build_goes_on(faulty_build):
    m, bundle, _ = faulty_build
    stage = next(s for s in m["stages"] if s["name"] == "onnx")
    assert stage["status"] == "failed" and "no opset" in stage["error"]
    assert _by_name(read_manifest(bundle), "aoti-cpu")["status"] == "verified"


@pytest.mark.slow  # builds a bundle
def test_artifact_over_tolerance_is_marked_unusable_with_the_figure(demo_ckpt, tmp_path, monkeypatch):
    from laya_aot.kinds import onnx as runners

    real = runners.ONNXRunner.__call__

    def noisy(self, *args):
        logits, act = real(self, *args)
        return logits + 0.5 * torch.arange(logits.shape[1]), act
    monkeypatch.setattr(runners.ONNXRunner, "__call__", noisy)
    with pytest.raises(BuildError, match="no artifact could be built and verified"):
        build_bundle(demo_ckpt, tmp_path / "b", "stages.aoti=false", *FAILURES)
    assert not (tmp_path / "b").exists()


def test_export_failure_stops_with_a_clear_message(demo_ckpt, tmp_path, monkeypatch):
    import laya_aot.kinds.exported_program as export

    def boom(*a, **k):
        raise RuntimeError("Constraints violated (tokens_16)")
    monkeypatch.setattr(export, "export_model", boom)
    with pytest.raises(BuildError, match="stage exported_program failed: RuntimeError: Constraints violated"):
        build_bundle(demo_ckpt, tmp_path / "b")
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.partial-*"))


def test_a_program_torch_cannot_load_back_is_not_shipped(faulty_build):
    """torch 2.11 saves autocast regions it cannot read back: the portable file, asked for
    (export.ship_program), is left out (said in the stage record and the log), and the compiled artifacts, built
    from the program in memory, still verify."""
    m, bundle, logged = faulty_build
    names = {a["name"]: a["status"] for a in m["artifacts"]}
    assert names == {"aoti-cpu": "verified", "onnx-cpu": "build_failed"}, names   # ONNX: the build's other fault
    (export,) = [s for s in m["stages"] if s["name"] == "exported_program"]
    assert "exported_program-fp32 not shipped" in export["summary"] and "wrap_with_autocast_2" in export["summary"]
    assert not list(bundle.glob("exported_program/*"))
    assert any("is not shipped" in message for message in logged)


def test_a_program_torch_cannot_save_is_named_instead_of_failing_the_stage(tmp_path, monkeypatch):
    """Some programs torch cannot serialise (torch 2.11: a uint64 tensor it has no name for): the stage says why
    and goes on with the program in memory, as for one it cannot load back (above)."""
    import torch

    from laya_aot.kinds import exported_program as export

    def refuses(program, path):
        Path(path).write_bytes(b"partial")
        raise KeyError(torch.uint64)
    monkeypatch.setattr(torch.export, "save", refuses)
    assert "cannot save the program (KeyError: torch.uint64)" in export._does_not_save(object(), tmp_path / "p.pt2")
    monkeypatch.setattr(torch.export, "save", lambda program, path: None)
    assert export._does_not_save(object(), tmp_path / "q.pt2") == ""


@pytest.mark.slow  # exports the program before it finds nothing to build
def test_nothing_to_build_fails(demo_ckpt, tmp_path):
    with pytest.raises(BuildError, match="no artifact could be built"):
        build_bundle(demo_ckpt, tmp_path / "b", "stages.aoti=false", "stages.onnx=false", *FAILURES)


def test_max_tokens_beyond_context_is_refused(demo_ckpt, tmp_path):
    with pytest.raises(BuildError, match="exceeds the checkpoint's context"):
        build_bundle(demo_ckpt, tmp_path / "b", "export.max_tokens=512")


@pytest.mark.slow  # makes a checkpoint and builds its bundle
def test_a_context_that_is_not_a_multiple_of_16_builds_by_default_and_the_artifact_serves_it(tmp_path):
    """A checkpoint of context 200 (not 16 x n) built with no export setting: exported to 208 tokens, every artifact
    verified, and the artifact (not laya's eager forward) answers states longer than the context as laya does.
    Before, the default export took 200 as it was and the build failed in torch.export."""
    import laya
    import numpy as np

    import laya_aot
    from laya_aot.demo import demo_shape, make_checkpoint, question_suite, state_text
    from tests.conftest import SMALL
    from tests.questions import assert_same_answers

    ckpt = make_checkpoint(tmp_path / "ckpt", demo_shape("tiny", max_len=200), seed=4)
    made = build_bundle(ckpt, tmp_path / "b", *SMALL)
    assert {a["ranges"]["max_tokens"] for a in made["artifacts"]} == {208}
    assert {a["status"] for a in made["artifacts"]} == {"verified"}
    agent = laya_aot.load(ckpt, bundle=tmp_path / "b", device="cpu", strict=True)
    eager = laya.load(str(ckpt), device="cpu")
    rng = np.random.default_rng(4)
    states = [state_text(rng, n) for n in (5, 90, 180, 400)]
    qs = dict(list(question_suite().items())[::6])
    for got, ref in zip(agent.predict_batch(states, qs), eager.predict_batch(states, qs)):
        assert_same_answers(got["answers"], ref["answers"])
    stats = agent.backend_object.stats
    assert stats["artifact_calls"] >= 1 and stats.get("eager_calls", 0) == 0, stats


def test_a_parallel_layout_checkpoint_is_refused_by_the_build_and_served_by_laya_eager(demo_ckpt, small_bundle,
                                                                                        tmp_path):
    """option_layout='parallel' (laya's trainer can write it): its masks are laya's eager forward's alone. The build
    refuses it with that reason and leaves no bundle; a bundle of the same weights loads it as laya eager, saying
    why, and answers as laya does."""
    import shutil

    import laya

    import laya_aot
    from tests.questions import assert_same_answers

    ckpt = tmp_path / "parallel"
    shutil.copytree(demo_ckpt, ckpt)
    cfg = json.loads((ckpt / "rl_agent_config.json").read_text())
    (ckpt / "rl_agent_config.json").write_text(json.dumps(dict(cfg, option_layout="parallel")))
    with pytest.raises(BuildError, match="option_layout='parallel'.*only laya's eager forward"):
        build_bundle(ckpt, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    with pytest.warns(RuntimeWarning, match="option_layout='parallel', which only laya's eager forward runs"):
        agent = laya_aot.load(ckpt, bundle=small_bundle, device="cpu")
    assert agent.backend == "eager"
    q = {"t": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "pay", "tech": "errors"}}}
    states = ["I was charged twice", "the server is down since this morning"]
    for got, ref in zip(agent.predict_batch(states, q), laya.load(str(ckpt), device="cpu").predict_batch(states, q)):
        assert_same_answers(got["answers"], ref["answers"])


def _start_build(ckpt: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "laya_aot.cli", "build", "checkpoint.path=%s" % ckpt,
                             "output_dir=%s" % out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _kill_after_export(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail("the build finished before it could be interrupted")
        if any(p.glob("exported_program/*.pt2") for p in out.parent.glob(".%s.partial-*" % out.name)):
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_killed_build_leaves_the_previous_bundle_intact(bundle_copy, demo_ckpt):
    before = read_manifest(bundle_copy)
    proc = _start_build(demo_ckpt, bundle_copy)
    _kill_after_export(proc, bundle_copy)
    after = read_manifest(bundle_copy)                      # still the old, complete bundle
    assert after["created"] == before["created"]
    assert all(_hash_problem(bundle_copy, a["name"]) is None for a in after["artifacts"])
    partials = list(bundle_copy.parent.glob(".bundle.partial-*"))
    assert partials and not any((p / MANIFEST).exists() for p in partials)
    from laya_aot.staging import clean_stale
    clean_stale(bundle_copy)                                # the next build removes what the killed one left
    assert not list(bundle_copy.parent.glob(".bundle.partial-*"))


@pytest.mark.slow  # a `laya-aot build` process, killed after its export
def test_killed_first_build_leaves_nothing_that_looks_complete(demo_ckpt, tmp_path):
    from laya_aot.manifest import BundleError

    out = tmp_path / "fresh"
    proc = _start_build(demo_ckpt, out)
    _kill_after_export(proc, out)
    assert not out.exists()
    with pytest.raises(BundleError, match="interrupted"):
        out.mkdir()
        read_manifest(out)


def test_cuda_target_on_a_cpu_machine_cross_compiles_tilelang(cuda_bundle):
    """No GPU here: AOTInductor and the Inductor cache say why they skipped; TileLang kernels are built
    for sm_90a, each hashed in the manifest, and left for the GPU machine to verify (conftest.cuda_bundle: a
    tiny checkpoint without amp_dtype built with target=sm_90 stages.onnx=false, as
    tests/numerics/test_precision.py checks its dtype)."""
    _, bundle = cuda_bundle(None)
    m = read_manifest(bundle)
    stages = {s["name"]: s for s in m["stages"]}
    assert stages["aoti"]["status"] == "skipped" and "GPU" in stages["aoti"]["error"]
    assert stages["inductor_cache"]["status"] == "skipped"
    assert stages["tilelang"]["status"] == "ok"
    tl = _by_kind(m, "tilelang")
    assert tl["status"] == "unverified" and tl["needs"]["gpu_arch"] == "sm_90a"
    kernels = tl["details"]["kernels"]
    assert kernels and all(k["status"] == "ok" and len(k["sha256"]) == 64 for k in kernels)
    assert _hash_problem(bundle, tl["name"]) is None


def test_an_output_dir_that_is_not_a_bundle_is_never_replaced(demo_ckpt, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(BuildError, match="is not a laya-aot bundle"):
        build_bundle(demo_ckpt, out)
    assert (out / "notes.txt").read_text() == "keep me"
