"""The faithful 16-bit path (export.precision=faithful) and the decision statement that tells it apart.

fp32 everywhere but the matrix products, whose dtype the build measures per checkpoint (fp16 where the activations
leave room, bf16 with the reason where they do not); the statement pairs a faithful artifact with laya's eager
forward in its products' dtype, on the decision suite and on its near ties, beside laya eager as it serves.
"""
from __future__ import annotations

import json
import logging
import shutil
import warnings

import pytest
import torch

from laya_aot.numerics import precision
from tests.conftest import FEW_DECISIONS, build_bundle


def test_fp16_only_where_the_measured_activations_leave_room():
    limit = precision.FP16_MAX / 16
    gemm, why = precision.gemm_dtype("bf16", "faithful", 11.3, limit * 0.99, 16.0, "encoder.layers.1.mlp.Wo")
    assert gemm == "fp16" and "within" in why and "encoder.layers.1.mlp.Wo" in why
    gemm, why = precision.gemm_dtype("fp16", "faithful", 11.3, limit * 1.01, 16.0)
    assert gemm == "bf16" and "overflow" in why
    assert precision.gemm_dtype("fp16", "faithful", float("inf"), 1.0)[0] == "bf16"
    assert precision.gemm_dtype("bf16", "faithful")[0] == "bf16"                         # nothing measured
    assert precision.gemm_dtype("bf16", "faithful", 1.0, 1.0, device="cpu")[0] == "bf16"  # no fast fp16 on CPUs
    assert precision.gemm_dtype("bf16", "laya", 1.0, 1.0) == ("bf16", precision.gemm_dtype("bf16", "laya")[1])
    assert precision.gemm_dtype("fp32", "faithful", 1e9, 1e9)[0] == "fp32"
    with pytest.raises(ValueError, match="export.precision='fast': one of faithful, laya"):
        precision.gemm_dtype("bf16", "fast")
    with pytest.raises(ValueError, match="export.fp16_headroom=0.5"):
        precision.gemm_dtype("bf16", "faithful", headroom=0.5)


def test_the_serving_dtype_check_takes_measured_products_in_the_other_16bit_dtype():
    """An artifact for bf16 agents whose products run in fp16 is the build's measured choice: it serves them; what
    no build writes (fp32 agents with 16-bit products) is refused, as an artifact for another dtype is."""
    assert precision.why_not("bf16", "bf16", "cuda", "fp16") is None
    assert precision.why_not("fp16", "fp16", "cuda", "bf16") is None
    assert precision.why_not("bf16", "bf16", "cuda") is None
    assert "computes in bf16 and this agent serves in fp16" in precision.why_not("bf16", "fp16", "cuda", "fp16")
    assert "damaged or hand-edited" in precision.why_not("fp32", "fp32", "cpu", "bf16")


def test_the_faithful_module_rounds_its_products_and_nothing_else(demo_ckpt):
    import laya

    from laya_aot.modeling.model import ExplicitDtypeModel, gemm_extremes
    from laya_aot.padding import option_probs
    from laya_aot.verification import random_rows

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = laya.load(str(demo_ckpt), device="cpu").model.float().eval()
    faithful = ExplicitDtypeModel(model, torch.bfloat16, torch.float32, gemm=torch.float16, head="answer_rows")
    weights = dict(faithful.named_parameters())
    assert weights["model.encoder.layers.0.mlp.Wi.weight"].dtype == torch.float16
    assert weights["model.head.layers.0.self_attn.in_proj_weight"].dtype == torch.float16
    assert weights["model.head.layers.1.linear2.weight"].dtype == torch.float16
    assert weights["model.head.layers.1.linear2.bias"].dtype == torch.float32          # added in fp32
    assert weights["model.scorer.1.weight"].dtype == weights["model.scorer.3.weight"].dtype == torch.float32
    assert weights["model.encoder.final_norm.weight"].dtype == torch.float32
    # the parameters keep laya's names: an AOTInductor package finds its weights in the checkpoint by them
    assert {k[len("model."):] for k in weights} == set(dict(model.named_parameters()))
    batch = random_rows(torch.Generator().manual_seed(3), [90, 61, 33], [4, 3, 2], 2000, 0)
    with torch.no_grad():
        ref = option_probs(model(*batch)[0], 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            laya_bf16 = option_probs(model(*batch)[0].float(), 4)
        got = option_probs(faithful(*batch)[0], 4)
        as_fp32 = option_probs(ExplicitDtypeModel(model, torch.bfloat16, torch.float32, gemm=torch.float32)(*batch)[0],
                               4)
    assert (as_fp32 - ref).abs().max() < 1e-5             # with fp32 products the path is laya's fp32 forward
    assert (got - ref).abs().max() * 5 < (laya_bf16 - ref).abs().max()
    seen = gemm_extremes(model, [batch], "cpu")
    # the encoder's four products per layer and the head's four per layer (its in_proj included)
    assert seen.products == 3 * 4 + 2 * 4 and 0 < seen.max_abs_input < 1e3 and seen.input_at


@pytest.fixture(scope="module")
def sm90_faithful(tmp_path_factory):
    """The tiny checkpoint with amp_dtype bf16, built for sm_90 on this CPU: the exported program for bf16 agents
    on the faithful path (verified here against laya eager) and ONNX; no TileLang."""
    from laya_aot.demo import demo_shape, make_checkpoint

    root = tmp_path_factory.mktemp("faithful")
    ckpt = make_checkpoint(root / "ckpt", demo_shape("tiny", amp_dtype="bf16"), seed=0)
    manifest = build_bundle(ckpt, root / "bundle", "target=sm_90", "stages.tilelang=false", "export.max_rows=8",
                            "export.ship_program=true", *FEW_DECISIONS)
    return root / "bundle", manifest


@pytest.mark.slow  # a build, its exported program verified on fp16 products on this CPU (slow here)
def test_fp16_products_are_chosen_recorded_and_stated(sm90_faithful, capsys):
    from laya_aot.commands import inspect

    bundle, manifest = sm90_faithful
    (ep,) = [a for a in manifest["artifacts"] if a["kind"] == "exported_program"]
    p, st = ep["precision"], ep["verify"]["decisions"]
    assert ep["dtype"] == "bf16" and p["policy"] == "faithful" and p["gemm"] == "fp16" and "within" in p["reason"]
    assert 0 < max(p["max_abs_gemm_input"], p["max_abs_gemm_output"]) * p["fp16_headroom"] < precision.FP16_MAX
    assert ep["status"] == "verified", ep["verify"]["reason"]
    near = st["near_ties"]
    assert st["compared_with"] == near["compared_with"] == "fp16" and near["decisions"] >= 64
    # on near ties the faithful artifact agrees with fp32 at least as often as laya eager in fp16 and in bf16
    assert near["artifact"] >= near["eager_in_dtype"] and near["artifact"] >= near["laya_serving"]
    assert near["artifact"] > near["laya_serving"] + 0.05
    assert inspect([str(bundle), "--json"], 0.0) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["artifacts"]}
    assert rows[ep["name"]]["precision"]["gemm"] == "fp16" and rows[ep["name"]]["decisions"]["near_ties"]
    assert inspect([str(bundle)], 0.0) == 0
    text = capsys.readouterr().out
    assert "bf16 (faithful, fp16 products)" in text and "near ties" in text and "laya eager fp16" in text


@pytest.mark.slow  # the activations measured in fp32 over the verify suite's cases
def test_a_checkpoint_that_would_overflow_fp16_gets_bf16_products_with_the_reason(demo_ckpt, tmp_path, caplog):
    """A checkpoint whose first feed-forward product is scaled up 1000x: in fp16 its next product's input would
    overflow (the forward turns non-finite), so the build takes bf16 and says why, in the log and the record."""
    import laya
    from safetensors.torch import load_file, save_file

    from laya_aot import laya_internals as laya_api
    from laya_aot.checkpoint import describe
    from laya_aot.config import compose
    from laya_aot.kinds import BuildContext
    from laya_aot.kinds.exported_program import choose_precision
    from laya_aot.modeling.model import ExplicitDtypeModel
    from laya_aot.variant import build_machine
    from laya_aot.verification import random_rows

    ckpt = tmp_path / "scaled"
    shutil.copytree(demo_ckpt, ckpt)
    state = load_file(str(ckpt / "model.safetensors"))
    name = "encoder.layers.0.mlp.Wi.weight"
    state[name] = (state[name].float() * 1000).to(state[name].dtype)
    assert torch.isfinite(state[name]).all()
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    cfg = compose(["checkpoint.path=%s" % ckpt, "target=sm_90", *FEW_DECISIONS])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya.load(str(ckpt), device="cpu")
    ctx = BuildContext(cfg=cfg, ckpt=ckpt, info=describe(ckpt, cfg.checkpoint), staging=tmp_path / "stage",
                       machine=build_machine("cuda"), device="cuda", dtypes=["bf16"], dtype="bf16", agent=agent,
                       pad_id=laya_api.pad_id(agent), vocab=laya_api.vocab(agent))
    with caplog.at_level(logging.WARNING, logger="laya_aot.kinds.exported_program"):
        chosen = choose_precision(ctx, "cpu", 256)
    assert chosen.gemm == "bf16" and chosen.policy == "faithful" and "overflow" in chosen.reason
    assert chosen.max_abs_gemm_output > precision.FP16_MAX / chosen.fp16_headroom
    assert any("matrix products in bf16: fp16 would risk overflow" in r.getMessage() for r in caplog.records)
    model = agent.model.float().eval()
    batch = random_rows(torch.Generator().manual_seed(1), [60, 45], [3, 2], ctx.vocab, ctx.pad_id)
    with torch.no_grad():
        in_fp16 = ExplicitDtypeModel(model, torch.bfloat16, torch.float32, gemm=torch.float16)(*batch)[0]
        in_bf16 = ExplicitDtypeModel(model, torch.bfloat16, torch.float32, gemm=torch.bfloat16)(*batch)[0]
    assert not torch.isfinite(in_fp16).all() and torch.isfinite(in_bf16).all()


@pytest.mark.slow  # laya eager in fp16 and bf16 and two fp16 artifacts on this CPU over 128 + 256 decisions
def test_the_statement_fails_an_artifact_less_faithful_than_its_products_promise(demo_ckpt):
    """The faithful artifact (fp16 products) holds its statement against laya eager fp16 and beats laya eager bf16
    on near ties; the same artifact with its residual stream rounded to bf16 after every layer, although still
    ahead of laya eager bf16 as served, fails it: the near ties show it."""
    import laya

    from laya_aot import laya_internals as laya_api
    from laya_aot.modeling.model import ExplicitDtypeModel
    from laya_aot.numerics.tolerance import near_tie_gap
    from laya_aot.padding import Ranges
    from laya_aot.verification import EagerFigures, cases, decision_cases, near_tie_pool, reference_outputs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya.load(str(demo_ckpt), device="cpu")
    model = agent.model.float().eval()
    vocab, pad = laya_api.vocab(agent), laya_api.pad_id(agent)
    ranges = Ranges(1, 8, 32, 256, 2, 64)
    case_list = cases(5, ranges, vocab, pad)
    figures = EagerFigures(model, case_list, reference_outputs(model, case_list),
                           decision_cases(6, ranges, vocab, pad, None, 128), 0.01,
                           near_tie_pool(7, ranges, vocab, pad, None, 2048), 256, pad)

    class Runner:
        device = torch.device("cpu")

        def __init__(self, module):
            self.module = module

        def __call__(self, *batch):
            return self.module(*batch)

    faithful = ExplicitDtypeModel(model, torch.bfloat16, torch.float32, gemm=torch.float16, head="answer_rows")
    worse = ExplicitDtypeModel(model, torch.bfloat16, torch.float32, gemm=torch.float16, head="answer_rows")
    for layer in list(worse.model.encoder.layers) + list(worse.model.head.layers):
        layer.register_forward_hook(lambda mod, inp, out: out.to(torch.bfloat16).float())
    gap = near_tie_gap(figures.get("bf16", "cpu"))  # as verify_artifact gives it
    good = figures.decisions(Runner(faithful), "bf16", ranges, pad, "fp16", gap)
    bad = figures.decisions(Runner(worse), "bf16", ranges, pad, "fp16", gap)
    assert good.holds and good.near_ties.decisions >= 200, good.describe()
    assert good.near_ties.artifact >= good.near_ties.eager_in_dtype and good.near_ties.artifact >= \
        good.near_ties.laya_serving + 0.05, good.describe()
    assert not bad.holds and bad.near_ties.p_value < bad.near_ties.alpha, bad.describe()
    assert bad.near_ties.artifact > bad.near_ties.laya_serving, bad.describe()   # yet ahead of laya bf16 as served
    assert "laya eager in fp16" in bad.describe() and "near ties" in bad.describe()
