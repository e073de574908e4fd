"""laya's precision policy, and verification relative to laya's own reduced precision.

The policy module is checked against laya's own functions (not a copy of them); the rule against a
checkpoint with decisive answers, where a fixed absolute bound rejected correct 16-bit artifacts.
"""
from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from laya_aot.numerics import precision
from laya_aot.numerics.tolerance import Agreement, Tolerance, rule_for
from tests.conftest import build_bundle


@pytest.mark.parametrize("amp", [None, "bf16", "fp16", "bfloat16", "float16", "fp32"])
@pytest.mark.parametrize("env", [None, "fp16", "bf16", "BFloat16", "float16", "fp8"])
def test_cuda_policy_is_lavas_own(amp, env, monkeypatch):
    import laya.agent

    if env is None:
        monkeypatch.delenv("LAYA_CUDA_AMP", raising=False)
    else:
        monkeypatch.setenv("LAYA_CUDA_AMP", env)
    # what laya.Agent does at compute capability >= 8 (agent.py): _cuda_amp_dtype(cfg.get("amp_dtype", "fp16"))
    cfg = {} if amp is None else {"amp_dtype": amp}
    theirs = {torch.bfloat16: "bf16", torch.float16: "fp16"}[laya.agent._cuda_amp_dtype(cfg.get("amp_dtype", "fp16"))]
    assert precision.expected_serving_dtype(cfg, "cuda", "sm_90") == theirs
    assert precision.cuda_dtype(amp, "sm_80", env) == theirs
    assert precision.cuda_dtype(amp, "sm_75", env) == "fp16"   # below 8.0 laya always takes fp16


@pytest.mark.parametrize("env, expect", [(None, "fp32"), ("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp32")])
def test_cpu_policy_matches_a_real_agent(env, expect, demo_ckpt, monkeypatch):
    import laya

    from laya_aot.laya_internals import serving_dtype

    if env is None:
        monkeypatch.delenv("LAYA_CPU_AMP", raising=False)
    else:
        monkeypatch.setenv("LAYA_CPU_AMP", env)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya.load(str(demo_ckpt), device="cpu")
    assert serving_dtype(agent) == precision.expected_serving_dtype({}, "cpu") == expect


def test_build_dtypes_follow_the_checkpoint_unless_asked():
    assert precision.build_dtypes("cuda", "sm_90", {}, []) == ["fp16"]          # amp_dtype absent
    assert precision.build_dtypes("cuda", "sm_90", {"amp_dtype": "bf16"}, []) == ["bf16"]
    assert precision.build_dtypes("cuda", "sm_75", {"amp_dtype": "bf16"}, []) == ["fp16"]
    assert precision.build_dtypes("cpu", None, {"amp_dtype": "bf16"}, []) == ["fp32"]
    assert precision.build_dtypes("cuda", "sm_90", {}, ["fp16", "bf16", "fp16"]) == ["fp16", "bf16"]
    with pytest.raises(ValueError, match="never serves fp32 on CUDA"):
        precision.build_dtypes("cuda", "sm_90", {}, ["fp32"])
    with pytest.raises(ValueError, match="never serves fp16 on the CPU"):
        precision.build_dtypes("cpu", None, {}, ["bf16", "fp16"])
    with pytest.raises(ValueError, match="fp8 is not a dtype"):
        precision.build_dtypes("cpu", None, {}, ["fp8"])


def test_the_rule_is_relative_to_laya_eager_in_the_same_dtype():
    tol = Tolerance()
    assert rule_for("fp32", tol).max_abs == 1e-4 and rule_for("fp32", tol).argmax_share == 1.0
    precise = rule_for("fp16", tol, Agreement(0.004, 0.003, 1.0))
    assert precise.max_abs == 0.02 and precise.argmax_share == pytest.approx(0.98)   # the absolute floor
    decisive = rule_for("bf16", tol, Agreement(0.03, 0.05, 0.97))
    assert decisive.max_abs == pytest.approx(0.10) and decisive.argmax_share == pytest.approx(0.95)
    assert "laya eager bf16" in decisive.describe()
    with pytest.raises(ValueError, match="judged against laya's eager forward in fp16"):
        rule_for("fp16", tol)


@pytest.fixture(scope="module")
def decisive(tmp_path_factory):
    """The issue's kind of checkpoint: head dim 32, one head layer, four actions, no amp_dtype, decisive."""
    import laya

    from laya_aot.demo import demo_shape, make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("decisive") / "ckpt",
                           demo_shape("tiny", hidden_size=96, num_attention_heads=3, head_layers=1, n_actions=4,
                                      head_gain=8.0), seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ckpt, laya.load(str(ckpt), device="cpu")


@pytest.mark.slow  # laya eager in 16 bits over the verification cases: 15-30 s
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_faithful_16bit_forward_passes_and_a_worse_one_fails(decisive, dtype):
    from laya_aot.modeling.model import ExplicitDtypeModel
    from laya_aot.numerics.dtypes import torch_dtype
    from laya_aot.padding import Ranges
    from laya_aot.verification import cases, eager_in_dtype, reference_outputs, verify_runner

    _, agent = decisive
    model = agent.model.float().eval()
    ranges = Ranges(1, 8, 32, 256, 2, 64)
    case_list = cases(3, ranges, 900, 0)
    refs = reference_outputs(model, case_list)
    eager = eager_in_dtype(model, dtype, case_list, refs)
    assert eager.worst > 1e-3, "the checkpoint is not decisive enough to show anything in %s" % dtype
    faithful = ExplicitDtypeModel(model, torch_dtype(dtype), torch.float32)
    rule = rule_for(dtype, Tolerance(), eager)
    ok = verify_runner(faithful, model, case_list, ranges, 0, torch.device("cpu"), rule, refs, eager)
    assert ok.passed, ok.reason
    assert ok.eager_in_dtype == eager and "laya eager %s" % dtype in ok.rule

    def off(*batch):  # a wrong artifact: option logits shifted, as a miscompiled head would give
        logits, act = faithful(*batch)
        return logits + 1.5 * torch.arange(logits.shape[1]), act
    bad = verify_runner(off, model, case_list, ranges, 0, torch.device("cpu"), rule, refs, eager)
    assert not bad.passed and "laya eager %s" % dtype in bad.reason


@pytest.mark.parametrize("amp, kernel_dtype", [(None, "float16"), ("bf16", "bfloat16")])
def test_cuda_target_builds_in_lavas_dtype_tilelang_included(amp, kernel_dtype, cuda_bundle):
    """On a CPU machine: the exported program and the TileLang kernels for sm_90 are in the dtype laya
    serves the checkpoint in on an H200 (amp_dtype absent: fp16), the 16-bit program verified against
    laya's eager forward in that dtype (conftest.cuda_bundle: a decisive tiny checkpoint)."""
    from laya_aot.bundle_format import read_manifest

    _, bundle = cuda_bundle(amp)
    m = read_manifest(bundle)
    want = "fp16" if amp is None else "bf16"
    (tl,) = [a for a in m["artifacts"] if a["kind"] == "tilelang"]
    (ep,) = [a for a in m["artifacts"] if a["kind"] == "exported_program"]
    assert tl["dtype"] == ep["dtype"] == want and m["checkpoint"]["amp_dtype"] == amp
    keys = [k["key"] for k in tl["details"]["kernels"]]
    assert keys and all("dtype-%s" % kernel_dtype in k for k in keys), keys[:3]
    assert ep["status"] == "verified" and ep["verify"]["eager_in_dtype"]["argmax_agreement"] > 0.9
    assert ep["verify"]["tolerance"] >= 0.02 and want in ep["verify"]["rule"]


@pytest.fixture(scope="module")
def two_dtype_bundle(demo_ckpt, tmp_path_factory):
    """The demo checkpoint's AOTInductor packages (not frozen, no ONNX) in fp32 and in bf16, each verified."""
    out = tmp_path_factory.mktemp("two-dtypes") / "b"
    build_bundle(demo_ckpt, out, "target.dtypes=[fp32,bf16]", "aoti.cpu_frozen=false", "stages.onnx=false")
    return out


@pytest.fixture(scope="module")
def bf16_bundle(two_dtype_bundle, tmp_path_factory):
    """A bundle with bf16 artifacts only, as `target.dtypes=[bf16]` builds it: a copy of two_dtype_bundle whose
    fp32 artifacts are left out (their files and their manifest entries). The bf16 artifacts are the ones that
    build made and verified, so the one build serves both fixtures (it used to be a second build of its own)."""
    from laya_aot import kinds
    from laya_aot.bundle_format import artifact_path, read_bundle, write_manifest

    out = tmp_path_factory.mktemp("bf16") / "b"
    shutil.copytree(two_dtype_bundle, out)
    m = read_bundle(out, kinds.NAMES)
    for art in m.artifacts:
        if art.dtype != "bf16":
            path = artifact_path(out, art)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    m.artifacts = [a for a in m.artifacts if a.dtype == "bf16"]
    assert {a.kind for a in m.artifacts} == {"aoti"}
    write_manifest(out, m)
    return out


def test_the_loader_serves_only_the_agents_dtype(demo_ckpt, bf16_bundle, monkeypatch):
    """On the CPU laya serves fp32, or bf16 with LAYA_CPU_AMP=bf16: each agent gets the artifact in its own
    dtype, and an artifact in another one is refused with the fix."""
    import laya_aot

    monkeypatch.delenv("LAYA_CPU_AMP", raising=False)
    with pytest.warns(RuntimeWarning, match=r"computes in bf16 and this agent serves in fp32.*target.dtypes=\[fp32\]"):
        agent = laya_aot.load(str(demo_ckpt), bundle=str(bf16_bundle), device="cpu")
    assert agent.backend == "eager"
    monkeypatch.setenv("LAYA_CPU_AMP", "bf16")
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bf16_bundle), device="cpu", strict=True)
    assert agent.backend == "aot:aoti" and agent.backend_object.artifact.dtype == "bf16"
    assert agent.backend_object.load_stats["serving_dtype"] == "bf16"


@pytest.mark.parametrize("mode", ["call", "rows"])
def test_decisions_equal_laya_eager_in_the_same_dtype(demo_ckpt, bf16_bundle, monkeypatch, mode):
    """A bf16 artifact and laya's eager bf16 forward round differently, so near-ties can fall either way;
    the backend hands the calls (or only the rows) with a row inside the tie margin to laya's eager forward,
    and every decision is laya's. The margin comes from the verify figures, so only a share of the rows is
    near a tie; "call" answers those calls exactly as laya does, probabilities included."""
    import laya
    import numpy as np

    import laya_aot
    from tests.questions import _answer_key, question_suite, state_text

    monkeypatch.setenv("LAYA_CPU_AMP", "bf16")
    rng = np.random.default_rng(1)
    states = [state_text(rng, n) for n in (4, 30, 120, 200, 60, 10)]
    qs = question_suite()
    ref = laya.load(str(demo_ckpt), device="cpu").predict_batch(states, qs)
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bf16_bundle), device="cpu", strict=True, near_ties=mode)
    assert agent.backend == "aot:aoti"
    got = agent.predict_batch(states, qs)
    keys = [(g["answers"][q], r["answers"][q]) for g, r in zip(got, ref) for q in r["answers"]]
    assert len(keys) >= 300
    assert all(_answer_key(a) == _answer_key(b) for a, b in keys)
    stats = agent.backend_object.stats
    assert stats["artifact_calls"] >= 1 and 0 < stats["near_tie_rows"] < len(keys) / 2, stats
    if mode == "call":   # one forward for the batch, with near-ties in it: laya's own answers, every figure
        assert stats["near_tie_whole_calls"] == stats["artifact_calls"] == 1, stats
        assert got == ref
    else:
        assert "near_tie_whole_calls" not in stats


def test_inspect_shows_both_figures(two_dtype_bundle, capsys):
    from laya_aot.commands import inspect

    assert inspect([str(two_dtype_bundle), "--json"], 0.0) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["artifacts"]}
    assert set(rows) == {"aoti-cpu-bf16", "aoti-cpu-fp32"}
    assert rows["aoti-cpu-fp32"]["here"] == "usable"               # this agent serves fp32
    assert "computes in bf16 and this agent serves in fp32" in rows["aoti-cpu-bf16"]["here"]
    for name, r in rows.items():
        assert r["rule"]
        if name.endswith("bf16"):
            assert r["eager_in_dtype"]["max_abs_option_prob"] >= 0 and r["tolerance"] >= 0.02
            assert r["tie_margin"] == pytest.approx(2 * (r["max_abs_option_prob"]
                                                         + r["eager_in_dtype"]["max_abs_option_prob"]))
        else:
            assert r["eager_in_dtype"] is None and r["tolerance"] == 1e-4
            assert r["tie_margin"] == pytest.approx(2 * r["max_abs_option_prob"])


def test_mcnemar_one_sided_is_the_exact_binomial_tail():
    from laya_aot.numerics.tolerance import decision_statement, mcnemar_one_sided

    assert mcnemar_one_sided(0, 0) == 1.0
    assert mcnemar_one_sided(10, 0) == 2.0 ** -10                      # every discordant decision against it
    assert mcnemar_one_sided(3, 3) == pytest.approx(42 / 64)           # P(X >= 3), X ~ Bin(6, 1/2)
    st = decision_statement([True, False, True, True], [True, True, False, True], alpha=0.01)
    assert (st.decisions, st.artifact, st.eager_in_dtype) == (4, 0.75, 0.75)
    assert (st.artifact_only_wrong, st.eager_only_wrong, st.p_value, st.holds) == (1, 1, 0.75, True)


def test_a_bf16_cpu_artifact_states_its_decisions_and_a_worse_one_fails(demo_ckpt, bf16_bundle):
    """The bf16 CPU path: the stored statement covers >= 2,000 decisions and holds; the same artifact with its
    logits perturbed (a worse artifact) fails the same statement, through the same functions the build uses."""
    import laya
    import torch

    from laya_aot import kinds
    from laya_aot import laya_internals as laya_api
    from laya_aot.bundle_format import artifact_path, read_bundle
    from laya_aot.numerics.tolerance import Tolerance
    from laya_aot.verification import EagerFigures, decision_cases

    m = read_bundle(bf16_bundle, kinds.NAMES)
    art = next(a for a in m.artifacts if a.kind == "aoti" and a.dtype == "bf16")
    st = art.verify.decisions
    assert art.status == "verified" and st is not None and st.decisions >= 2000 and st.holds
    assert st.artifact >= st.eager_in_dtype - 0.02 and 0 < st.eager_in_dtype <= 1
    agent = laya.load(str(demo_ckpt), device="cpu")
    model = agent.model.float().eval()
    runner = kinds.load(artifact_path(bf16_bundle, art), art,
                        kinds.LoadEnv(device="cpu", tensors=kinds.model_tensors(model)))
    g = torch.Generator().manual_seed(0)

    def worse(*xs):
        logits, act = runner(*xs)
        return logits + 0.5 * torch.randn(logits.shape, generator=g), act

    worse.device = runner.device
    tol = Tolerance()
    suite = decision_cases(77, art.ranges, laya_api.vocab(agent), laya_api.pad_id(agent), None, tol.decisions)
    figures = EagerFigures(model, [], {}, suite, tol.decisions_alpha)
    good = figures.decisions(runner, "bf16", art.ranges, laya_api.pad_id(agent))
    bad = figures.decisions(worse, "bf16", art.ranges, laya_api.pad_id(agent))
    assert good.holds and good.decisions >= 2000
    assert not bad.holds and bad.artifact < good.artifact and bad.p_value < tol.decisions_alpha
