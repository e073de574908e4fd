"""The thin loader: an artifact serves a laya Agent whose eager module is built only when something needs it."""
from __future__ import annotations

import dataclasses
import time
import warnings

import laya
import numpy as np
import pytest
import torch

import laya_aot
from laya_aot import laya_internals as laya_api
from tests.questions import assert_same_answers, question_suite, state_text

STATES = [state_text(np.random.default_rng(7), n) for n in (12, 40, 90)]


@pytest.fixture(scope="module")
def reference(demo_ckpt):
    eager = laya.load(str(demo_ckpt), device="cpu")
    return eager.predict_batch(STATES, question_suite())


def test_the_artifact_serves_a_thin_agent_whose_answers_are_laya_eagers(demo_ckpt, demo_bundle, reference):
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True)
    bo = agent.backend_object
    assert agent.backend.startswith("aot:") and laya_api.is_thin(agent)   # laya's eager module was never built
    assert bo.load_stats["thin_agent"] is True and bo.eager_module.model is None
    for got, ref in zip(agent.predict_batch(STATES, question_suite()), reference):
        assert_same_answers(got["answers"], ref["answers"])
    assert bo.eager_module.model is None and bo.stats.get("eager_calls", 0) == 0   # every answer was the artifact's


def test_a_request_beyond_the_export_builds_laya_eagers_module_and_answers_correctly(demo_ckpt, demo_bundle,
                                                                                     reference):
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True)
    bo = agent.backend_object
    # an export that takes at most 2 options: every wider question is beyond it and goes to laya's eager forward
    bo.ranges = dataclasses.replace(bo.ranges, max_markers=2)
    for got, ref in zip(agent.predict_batch(STATES, question_suite()), reference):
        assert_same_answers(got["answers"], ref["answers"])
    assert bo.stats["eager_calls"] >= 1 and bo.eager_module.model is not None
    assert bo.eager_module.stats["eager_module"] == "built"
    assert "laya's eager forward answers" in bo.eager_module.stats["eager_module_why"]
    assert laya_api.is_thin(agent)   # the agent's own module stays a shell; the backend holds the real one


def test_layas_own_set_backend_on_a_thin_agent_serves_lavas_eager_forward(demo_ckpt, demo_bundle, reference):
    """`agent.set_backend("eager")` (laya's API for switching backends) replaces the artifact with laya's forward, on
    laya's module: built then, since the thin agent had none. Before, every later call failed ("Module [Module] is
    missing the required 'forward' function": the shell of meta tensors)."""
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True)
    eager = agent.backend_object.eager_module
    assert laya_api.is_thin(agent) and eager.model is None
    assert agent.set_backend("eager") == "eager" and agent.backend == "eager"
    assert not laya_api.is_thin(agent) and agent.model is eager.model
    assert eager.stats["eager_module_why"] == "laya's set_backend was called"
    for got, ref in zip(agent.predict_batch(STATES, question_suite()), reference):
        assert_same_answers(got["answers"], ref["answers"])
    assert agent.accelerate() is False   # laya's own answer on a CPU, on laya's module as for any laya agent


def test_eager_module_modes(demo_ckpt, demo_bundle):
    now = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", eager_module="now")
    assert not laya_api.is_thin(now) and now.backend_object.eager_module is None
    bg = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", eager_module="background")
    bg.backend_object.eager_module._thread.join(60)
    assert bg.backend_object.eager_module.stats["eager_module"] == "built"
    assert "in the background" in bg.backend_object.eager_module.stats["eager_module_why"]
    with pytest.raises(ValueError, match="eager_module='sometimes' is not one of lazy, background, now"):
        laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), eager_module="sometimes")


def test_a_near_tie_mode_builds_the_eager_module_in_the_background(demo_ckpt, demo_bundle):
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", near_ties="call")
    em = agent.backend_object.eager_module
    em._thread.join(60)
    assert em.stats["eager_module"] == "built" and "near_ties='call'" in em.stats["eager_module_why"]


def test_no_usable_artifact_falls_back_to_a_whole_laya_agent(demo_ckpt, bundle_copy, reference):
    (bundle_copy / "bundle.json").write_text("{}", encoding="utf-8")   # no artifact can be trusted
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu")
    assert agent.backend == "eager" and not laya_api.is_thin(agent)
    assert agent.backend_object.stats["eager_module"] == "built"
    for got, ref in zip(agent.predict_batch(STATES, question_suite()), reference):
        assert_same_answers(got["answers"], ref["answers"], tol=0.0)   # laya's own forward: identical


def test_a_checkpoint_of_another_shape_serves_thin_with_laya_eagers_answers(alt_ckpt, alt_bundle):
    """tiny-alt: head dim 32, three heads, one decision-head layer, four actions, amp_dtype fp16 written out."""
    eager = laya.load(str(alt_ckpt), device="cpu")
    agent = laya_aot.load(str(alt_ckpt), bundle=str(alt_bundle), device="cpu", strict=True)
    assert agent.backend.startswith("aot:") and laya_api.is_thin(agent)
    assert laya_api.vocab(agent) == laya_api.vocab(eager) and laya_api.pad_id(agent) == laya_api.pad_id(eager)
    for got, ref in zip(agent.predict_batch(STATES, question_suite()), eager.predict_batch(STATES, question_suite())):
        assert_same_answers(got["answers"], ref["answers"])


def _module_route(monkeypatch, tmp_path, runs_module):
    """The loader told that the artifacts `runs_module(art)` picks run laya's own module (as TileLang's route does),
    an empty verdict cache (a first start on this machine: the probe child runs), and a record, per probed
    artifact, of whether laya's module was building when its verdict was awaited."""
    from laya_aot.runtime import trial

    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(trial, "_runs_module", runs_module)
    _package_first(monkeypatch)  # a native first candidate (probed), whatever a noisy build's figures ranked first
    building_at_probe = []
    real = trial.Trial._probe

    def probe(self, art, stats, *taken):
        building_at_probe.append((art.name, self.eager is not None and self.eager._thread is not None))
        return real(self, art, stats, *taken)
    monkeypatch.setattr(trial.Trial, "_probe", probe)
    return building_at_probe


def test_a_route_that_runs_laya_module_builds_it_while_its_probe_runs(demo_ckpt, other_facts_bundle, reference,
                                                                        monkeypatch, tmp_path):
    """A first start on a machine unlike the build's: the module is building in a thread before the probe's verdict
    is waited for (the child takes seconds in another process), and the artifact serves it once both are done, with
    laya eager's answers. A later start (the verdict cached) builds it when the artifact loads: nothing would
    overlap."""
    demo_bundle = other_facts_bundle
    seen = _module_route(monkeypatch, tmp_path, lambda art: True)
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True, probe=True)
    stats = agent.backend_object.load_stats
    assert agent.backend.startswith("aot:") and [b for _, b in seen] == [True]
    assert "built while its probe runs, in the background" in stats["eager_module_why"]
    assert stats["eager_module"] == "built" and stats["eager_module_wait_s"] >= 0
    for got, ref in zip(agent.predict_batch(STATES, question_suite()), reference):
        assert_same_answers(got["answers"], ref["answers"])
    seen.clear()
    later = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True, probe=True)
    assert [b for _, b in seen] == [False] and later.backend_object.load_stats["probe"] == "cached"
    assert "probe" not in later.backend_object.load_stats["eager_module_why"]


def test_a_module_built_for_a_rejected_artifact_is_discarded_when_another_serves(demo_ckpt, other_facts_bundle,
                                                                                 reference, monkeypatch, tmp_path):
    """The first candidate runs laya's module and its probe (a child: a machine unlike the build's) fails; the next
    one, which does not run it, serves the thin agent: the module built beside the failed probe is not left
    holding the weights again."""
    from laya_aot.runtime import trial

    demo_bundle = other_facts_bundle
    first = []

    def runs_module(art):
        first.append(art.name) if not first else None
        return art.name == first[0]
    seen = _module_route(monkeypatch, tmp_path, runs_module)
    probing = trial.Trial._probe

    def probe(self, art, stats, *taken):
        why = probing(self, art, stats, *taken)
        return "refused by the test" if art.name == first[0] else why
    monkeypatch.setattr(trial.Trial, "_probe", probe)
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", probe=True)
    bo = agent.backend_object
    assert seen[0] == (first[0], True) and bo.artifact.name != first[0]
    assert laya_api.is_thin(agent) and bo.eager_module.model is None
    assert bo.load_stats["eager_module"] == "discarded"
    assert first[0] in bo.load_stats["eager_module_discarded_why"]
    for got, ref in zip(agent.predict_batch(STATES, question_suite()), reference):
        assert_same_answers(got["answers"], ref["answers"])


def _package_first(monkeypatch):
    """Rank the AOTInductor package that takes its weights at load (not the frozen one) first, in the one start
    order the loader and its head start share (`select.select`)."""
    from laya_aot.runtime import select

    real = select.rank

    def rank(arts, device, prefer=None, starts=None, here=None):
        order, skipped = real(arts, device, prefer, starts, here)
        return sorted(order, key=lambda a: a.name != "aoti-cpu"), skipped
    monkeypatch.setattr(select, "rank", rank)


def test_the_weights_reach_the_device_beside_laya_load_and_serve_laya_eagers_answers(demo_ckpt, demo_bundle,
                                                                                    reference, monkeypatch):
    _package_first(monkeypatch)
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True)
    bo = agent.backend_object
    assert bo.artifact.name == "aoti-cpu" and laya_api.is_thin(agent)
    assert bo.load_stats["constants_prepared"] is True and bo.load_stats["weights_prepared_early_s"] >= 0
    # loaded beside laya's load, after the probe's verdict
    assert bo.load_stats["loaded_early"] is True and bo.load_stats["probe"] in ("ran", "cached", "shipped")
    for got, ref in zip(agent.predict_batch(STATES, question_suite()), reference):
        assert_same_answers(got["answers"], ref["answers"])
    # a whole agent's artifact takes laya's module's tensors, never weights read early from the file
    whole = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True, eager_module="now")
    assert whole.backend_object.artifact.name == "aoti-cpu"
    assert "constants_prepared" not in whole.backend_object.load_stats


def test_the_smoke_check_is_the_artifacts_first_call_and_without_it_the_head_start_warms_it_up(demo_ckpt,
                                                                                               demo_bundle,
                                                                                               monkeypatch):
    """Two forwards in a row on a start's critical path (warm-up, then smoke check) where one does: the head start
    calls the artifact only when no smoke check follows, so the first request never pays the first call's loads.
    The package goes first whatever the session's start costs say (ONNX, loaded later, starts faster here)."""
    _package_first(monkeypatch)
    checked = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True).backend_object
    assert checked.load_stats["loaded_early"] is True and checked.load_stats["smoke_check_s"] >= 0
    assert "warm_up_s" not in checked.load_stats
    unchecked = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True,
                              smoke_check=False).backend_object
    assert unchecked.load_stats["loaded_early"] is True and unchecked.load_stats["warm_up_s"] >= 0
    assert "smoke_check_s" not in unchecked.load_stats


def test_prepared_weights_are_the_ones_the_package_would_read(demo_ckpt, demo_bundle):
    import torch

    from laya_aot.checkpoint import Weights
    from laya_aot.kinds import aoti

    path = demo_bundle / "aoti-cpu"
    prepared = aoti.prepare(path, Weights(demo_ckpt), "cpu")
    early, late = aoti.AOTIRunner(path, {}, "cpu", prepared=prepared), aoti.AOTIRunner(path, Weights(demo_ckpt), "cpu")
    assert early.stats["constants_prepared"] is True and "constants_prepared" not in late.stats
    assert set(early._consts) == set(late._consts)
    for fqn, t in late._consts.items():
        assert early._consts[fqn].dtype == t.dtype and torch.equal(early._consts[fqn], t), fqn
    ids = torch.full((2, 32), 7, dtype=torch.long)
    batch = (ids, torch.ones_like(ids), torch.tensor([[1, 2, 3, 0]] * 2), torch.tensor([[True, True, True, False]] * 2),
             torch.zeros((2,), dtype=torch.long))
    for a, b in zip(early(*batch), late(*batch)):
        assert torch.equal(a, b)
    assert aoti.prepare(demo_bundle / "aoti-cpu-frozen", Weights(demo_ckpt), "cpu") is None  # weights inside


def test_a_head_start_closed_while_its_probe_runs_kills_it_and_caches_nothing(demo_ckpt, other_facts_bundle, tmp_path,
                                                                              monkeypatch, probe_starts):
    import time

    from laya_aot.runtime.head_start import HeadStart
    from laya_aot.runtime.loader import LoadConfig, LoadSession

    demo_bundle = other_facts_bundle  # a machine unlike the build's: its first start runs a child
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    _package_first(monkeypatch)
    started = probe_starts
    hs = HeadStart(LoadSession.open(demo_ckpt, demo_bundle, LoadConfig(device="cpu")), thin=True)
    deadline = time.monotonic() + 60
    while not started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert started and started[0].proc.poll() is None   # the child is still importing torch
    hs.close()
    assert started[0].cancelled and started[0].proc.poll() is not None
    assert not list((tmp_path / "cache" / "probes").glob("*.json"))   # a cancelled probe says nothing: not cached
    taken = hs.take("aoti-cpu", "cpu")   # what it worked on, with nothing loaded or prepared left in it
    assert taken is not None and taken.runner is None and taken.prepared() is None


def _incoming(path, ckpt):
    import json

    from safetensors.torch import load_file

    from laya_aot.checkpoint import Weights
    from laya_aot.kinds import aoti

    spec = json.loads((path / aoti.CONSTANTS).read_text())
    extra = load_file(str(path / aoti.EXTRA)) if (path / aoti.EXTRA).exists() else {}
    return aoti.incoming_constants(spec, extra, Weights(ckpt), "cpu")


def test_weights_handed_over_unwritten_are_read_in_place_once_written(demo_ckpt, demo_bundle):
    """A GPU start hands the package its constants before their bytes are written (`kinds.Incoming`), then writes
    them while the package makes its first call: the runner must not come back before the bytes are in, and must
    then answer with them (read in place), exactly as a runner given written weights does."""
    import torch

    from laya_aot.checkpoint import Weights
    from laya_aot.kinds import aoti
    from laya_aot.padding import batch_of_shape

    path = demo_bundle / "aoti-cpu"
    incoming = _incoming(path, demo_ckpt)
    for t in incoming.tensors.values():
        t.fill_(float("nan"))   # unwritten: a package that copied them at hand-over would answer NaN
    written = incoming._fill

    def slow_fill():
        time.sleep(0.3)
        written()
    incoming._fill = slow_fill
    t0 = time.perf_counter()
    early = aoti.AOTIRunner(path, {}, "cpu", prepared=incoming, early_calls=[batch_of_shape(2, 32, 4)])
    assert time.perf_counter() - t0 >= 0.3 and incoming.done
    assert early.stats["early_calls"] == 1 and early.stats["constants_written_wait_s"] >= 0
    late = aoti.AOTIRunner(path, Weights(demo_ckpt), "cpu")
    batch = batch_of_shape(3, 48, 4)
    for a, b in zip(early(*batch), late(*batch)):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_weights_that_could_not_be_written_fail_the_load(demo_ckpt, demo_bundle):
    from laya_aot.kinds import aoti

    path = demo_bundle / "aoti-cpu"
    incoming = _incoming(path, demo_ckpt)

    def broken():
        raise OSError("disk gone")
    incoming._fill = broken
    with pytest.raises(RuntimeError, match="could not be copied to the device: OSError: disk gone"):
        aoti.AOTIRunner(path, {}, "cpu", prepared=incoming)
    incoming.fill()   # a second fill does not copy again: it waits for the first, and the failure stays
    with pytest.raises(RuntimeError, match="disk gone"):
        incoming.wait()


def test_a_start_warms_the_artifact_at_the_smoke_checks_shape(demo_bundle):
    from laya_aot import kinds
    from laya_aot.bundle_format import read_bundle
    from laya_aot.padding import smallest_batch
    from laya_aot.runtime.head_start import warm_batches
    from laya_aot.verification import smoke_from_record

    manifest = read_bundle(demo_bundle, kinds.BY_NAME)
    art = next(a for a in manifest.artifacts if a.name == "aoti-cpu")
    (batch,) = warm_batches(art, manifest.smoke)
    ids, _, mpos, _, _ = smoke_from_record(manifest.smoke)[0]
    assert batch[0].shape == (ids.shape[0], art.ranges.padded_tokens(ids.shape[1]))
    assert batch[2].shape == (ids.shape[0], art.ranges.padded_markers(mpos.shape[1]))
    (small,) = warm_batches(art, None)   # no record: the smallest batch
    assert all(a.shape == b.shape for a, b in zip(small, smallest_batch(art.ranges)))


def test_a_first_start_checks_large_weights_by_their_parts_and_a_wrong_record_is_refused(demo_ckpt, bundle_copy,
                                                                                         reference, tmp_path,
                                                                                         monkeypatch):
    """A bundle recording the weights' `sha256_parts` (what a build records for weights of
    `checkpoint.LARGE_FILE_BYTES` or more): a start on a machine that never saw the checkpoint checks them by
    that digest, never by their sha256, and serves; a record that is not the file's is refused, with the reason."""
    import json

    from laya_aot import checkpoint, files
    from laya_aot.runtime.loader import NoArtifactError

    monkeypatch.setattr(checkpoint, "LARGE_FILE_BYTES", (demo_ckpt / "model.safetensors").stat().st_size)

    def record(parts):
        m = json.loads((bundle_copy / "bundle.json").read_text())
        m["checkpoint"]["fingerprint"].update(parts={"model.safetensors": parts}, part_bytes=files.PART_BYTES)
        (bundle_copy / "bundle.json").write_text(json.dumps(m))

    record(files.sha256_parts(demo_ckpt / "model.safetensors"))
    hashed = []
    real = files.sha256_file
    monkeypatch.setattr(files, "sha256_file", lambda p: hashed.append(str(p)) or real(p))
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "first-start"))
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)
    assert agent.backend.startswith("aot:") and hashed                  # the small files were hashed...
    assert not any(p.endswith("model.safetensors") for p in hashed)     # ...the weights only by their parts
    for got, ref in zip(agent.predict_batch(STATES, question_suite()), reference):
        assert_same_answers(got["answers"], ref["answers"])
    record("0" * 64)
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "another-first-start"))
    with pytest.raises(NoArtifactError, match="built from another checkpoint .*differing: model.safetensors"):
        laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)


class _ShortOfMemory:
    """The artifact's runner, out of memory for more than `fits` rows at once (as a GPU with little room left)."""

    def __init__(self, runner, fits: int, error=torch.OutOfMemoryError):
        self.runner, self.fits, self.error = runner, fits, error
        self.device, self.takes_host_inputs = runner.device, getattr(runner, "takes_host_inputs", False)
        self.rows_run: list = []
        self.misaligned = 0   # inputs whose data does not start on 16 bytes (an AOTInductor package copies them)

    def __call__(self, *batch):
        if batch[0].shape[0] > self.fits:
            raise self.error("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.rows_run.append(batch[0].shape[0])
        self.misaligned += sum(x.data_ptr() % 16 != 0 for x in batch)
        return self.runner(*batch)


def test_a_call_out_of_memory_runs_in_halves_and_every_answer_is_the_artifacts(demo_ckpt, demo_bundle, reference):
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True)
    bo = agent.backend_object
    bo.runner = short = _ShortOfMemory(bo.runner, fits=2)
    got = agent.predict_batch(STATES, question_suite())
    for g, ref in zip(got, reference):
        assert_same_answers(g["answers"], ref["answers"])
    assert short.rows_run and max(short.rows_run) <= 2 and short.misaligned == 0
    assert bo.stats["out_of_memory_halvings"] >= 1 and bo.stats.get("eager_calls", 0) == 0
    assert laya_api.is_thin(agent) and bo.eager_module.model is None   # laya's module was never needed


def test_one_row_out_of_memory_is_torchs_error_and_other_errors_pass_unchanged(demo_ckpt, demo_bundle):
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True)
    bo = agent.backend_object
    runner = bo.runner
    bo.runner = _ShortOfMemory(runner, fits=0)
    with pytest.raises(torch.OutOfMemoryError, match="ran out of memory on cpu for one row"):
        agent.predict_batch(STATES[:1], dict(list(question_suite().items())[:1]))
    bo.reset_stats()
    bo.runner = _ShortOfMemory(runner, fits=0, error=ValueError)   # not an out-of-memory: raised once, as it came
    with pytest.raises(ValueError, match="Tried to allocate"):
        agent.predict_batch(STATES, question_suite())
    assert "out_of_memory_halvings" not in bo.stats


def _out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_layas_retry_on_the_cpu_after_running_out_of_memory_leaves_a_thin_agent_served_by_the_artifact(
        demo_ckpt, demo_bundle, reference):
    """laya's own retry (`Agent._infer`): after the forward ran out of memory on an accelerator it takes its write
    lock, calls `deaccelerate()`, moves the agent's module to the CPU, answers there and moves the module back. On
    the shell of meta tensors that move raised inside the retry; with laya's module given for the retry,
    a GPU still full refused the move back and left the agent on the CPU, laya's eager forward serving every later
    call (seen on an H200). Here the agent's device is `meta`, which laya treats as an accelerator: the forward
    runs out of memory there and laya's retry answers on the CPU; laya's move of its module back to `meta` (raising
    here, refused by a full GPU there) must not be made: the shell goes back and the artifact serves again."""
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True)
    bo, eager, shell = agent.backend_object, agent.backend_object.eager_module, agent.model
    kept = []
    for retry in (1, 2):
        # the artifact's call on the accelerator, either way in: the batch on the host, or laya's after it
        agent.model.forward = bo.host_call = _out_of_memory
        agent.device = torch.device("meta")
        with pytest.warns(RuntimeWarning, match="Retrying this request on CPU"):
            got = agent.predict_batch(STATES, question_suite())
        for g, ref in zip(got, reference):   # laya's fp32 forward on the CPU answered
            assert_same_answers(g["answers"], ref["answers"])
        assert agent.cpu_fallback_count == retry
        assert agent.device == torch.device("meta") and agent.model is shell and laya_api.is_thin(agent)
        assert agent.backend_object is bo and agent.model.forward == bo.forward   # laya installed it again
        assert eager.model is None and eager.retry_module is not None   # kept on the CPU for the next retry
        assert next(eager.retry_module.parameters()).device.type == "cpu"
        assert eager.stats["layas_retries_ended"] == retry
        kept.append(eager.retry_module)
    assert kept[0] is kept[1]   # built once, for both retries
    assert "built on the CPU for laya's retry" in eager.stats["eager_module_why"]
    del bo.host_call
    agent.device = torch.device("cpu")
    before = bo.stats.get("artifact_calls", 0)
    for got, ref in zip(agent.predict_batch(STATES, question_suite()), reference):
        assert_same_answers(got["answers"], ref["answers"])
    assert bo.stats["artifact_calls"] > before and bo.stats.get("eager_calls", 0) == 0   # the artifact again


def test_laya_aots_own_backend_swaps_build_no_eager_module(demo_ckpt, demo_bundle):
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True)
    bo = agent.backend_object
    laya_api.install_backend(agent, bo)   # as a hand-over swaps artifacts: laya's deaccelerate, not the guard
    assert laya_api.is_thin(agent) and bo.eager_module.model is None and agent.backend_object is bo


def test_laya_module_for_layas_retry_is_built_on_the_cpu_and_a_device_out_of_memory_elsewhere_raises(
        demo_ckpt, demo_bundle, monkeypatch):
    """laya's retry runs laya's module on the CPU, so it is built there, never on the device that just ran out of
    memory (on an H200 filled to 3 MB the build there ran out too). Anywhere else the device's
    out-of-memory is the caller's."""
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True)
    eager = agent.backend_object.eager_module
    real = laya_api.build_eager_module
    asked = []

    def short(agent_, checkpoint, device=None):
        asked.append(device)
        if device is None:   # the agent's device: out of memory
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.56 GiB")
        return real(agent_, checkpoint, device)

    monkeypatch.setattr(laya_api, "build_eager_module", short)
    shell = agent.model
    with agent._gate.write_lock():   # as laya holds it
        agent.deaccelerate()
    assert asked == [torch.device("cpu")] and agent.model is eager.retry_module is eager.model
    agent._restore_runtime(agent.device, agent.dtype, agent.amp_enabled, False)
    assert agent.model is shell and eager.model is None
    with pytest.raises(torch.OutOfMemoryError):
        eager.install("a test")


def test_the_decoding_check_runs_during_the_load_not_on_the_first_call(demo_ckpt, demo_bundle, monkeypatch):
    """The host path's one check per process (its batched decoding against laya's) starts once laya's agent exists,
    beside the artifact's load, so the first answer does not pay for it."""
    from laya_aot.runtime import host_steps

    monkeypatch.setattr(host_steps, "_CHECKED", {})
    checked = []
    self_check = host_steps.self_check
    monkeypatch.setattr(host_steps, "self_check", lambda agent: checked.append(1) or self_check(agent))
    agent = laya_aot.load(str(demo_ckpt), bundle=str(demo_bundle), device="cpu", strict=True)
    deadline = time.monotonic() + 60
    while "decode" not in host_steps._CHECKED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host_steps._CHECKED == {"decode": True} and checked == [1]   # done with no call made
    agent.predict_batch(STATES[:1], question_suite())
    assert checked == [1]
