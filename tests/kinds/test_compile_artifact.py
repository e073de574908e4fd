"""The compile artifact (saved Inductor cache) end to end on the CPU: what CI can check of a CUDA route.

The build stage only runs for CUDA targets, so this drives its two halves directly on the CPU:
`build_cache` compiles one dynamic graph and saves the cache artifacts; `CompileRunner` loads them in a
reset Dynamo and must answer like eager for every verification case, including one-row requests,
which it pads to two rows so that the saved graph (not a size-1 specialisation) serves them.
The build itself (`build_artifact`, the stage past its CUDA gate) is driven on the CPU where the precompiled
function fails: it must ship the saved cache and say why.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch

from laya_aot.kinds.inductor_cache import (
    CACHE_FILE,
    INFO_FILE,
    MIN_ROWS,
    build_cache,
    check_in_fresh_process,
    pad_rows,
    warm_shapes,
)
from laya_aot.numerics.tolerance import Rule
from laya_aot.padding import Ranges
from laya_aot.verification import cases, verify_runner


def test_pad_rows_repeats_the_last_row_only_when_needed():
    batch = (torch.arange(6).view(1, 6), torch.ones(1, 6, dtype=torch.long), torch.tensor([[1, 2]]),
             torch.ones(1, 2, dtype=torch.bool), torch.tensor([2]))
    padded = pad_rows(batch)
    assert [t.shape[0] for t in padded] == [MIN_ROWS] * 5
    assert all(torch.equal(p[0], p[1]) and torch.equal(p[:1], b) for p, b in zip(padded, batch))
    two = tuple(torch.cat([t, t]) for t in batch)
    assert pad_rows(two) is two


def test_one_warm_shape_with_more_than_one_row():
    ((rows, tokens),) = warm_shapes(Ranges(1, 64, 16, 1024, 2, 64))
    assert rows >= MIN_ROWS and tokens % 16 == 0
    ((rows, _),) = warm_shapes(Ranges(1, 1, 16, 256, 2, 8))
    assert rows == MIN_ROWS  # even when the export allows one row


@pytest.fixture(scope="module")
def even_head_ckpt(tmp_path_factory):
    """A tiny checkpoint whose decision head has 2 attention heads: an even count, so under no_grad
    nn.TransformerEncoderLayer would take its fused path, as a ModernBERT-large-sized head (16) does."""
    from laya_aot.demo import DemoShape, make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "even", DemoShape(hidden_size=128), seed=1)


_FUSED = torch._transformer_encoder_layer_fwd


def _untraceable(*args, **kwargs):
    """The fused op as torch 2.11 has it: eager runs it, Dynamo cannot trace it."""
    if torch.compiler.is_compiling():
        raise RuntimeError("the fused encoder-layer op, which torch 2.11's Dynamo cannot trace")
    return _FUSED(*args, **kwargs)


@pytest.mark.slow  # compiles with Inductor, and again in a fresh process
def test_saved_cache_serves_a_fresh_dynamo_like_eager(even_head_ckpt, tmp_path, monkeypatch):
    import laya

    from laya_aot.kinds.inductor_cache import CompileRunner

    agent = laya.load(str(even_head_ckpt), device="cpu")
    assert agent.model.head.layers[0].self_attn.num_heads % 2 == 0
    # stand in for torch 2.11, whose Dynamo cannot trace the fused op (a graph break on an H200):
    # the build and the runner must not reach it; a plain full-graph compile does, which shows the
    # stand-in is in the way
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", _untraceable)
    plain = torch.compile(agent.model.float().eval(), backend="eager", fullgraph=True)
    with torch.no_grad(), pytest.raises(Exception, match="fused encoder-layer"):
        plain(*cases(3, Ranges(1, 8, 16, 256, 2, 64), 100, 0)[0].batch)
    torch._dynamo.reset()
    ranges = Ranges(1, 8, 16, int(agent.cfg.get("max_len", 256)), 2, 64)
    facts = build_cache(agent, tmp_path / "compile", ranges, "fp32", "fp32", device="cpu")
    assert facts["bytes"] > 0 and (tmp_path / "compile" / CACHE_FILE).stat().st_size == facts["bytes"]
    assert json.loads((tmp_path / "compile" / INFO_FILE).read_text())["shapes"] == facts["shapes"]
    torch._dynamo.reset()
    runner = CompileRunner(tmp_path / "compile", agent.model.float().eval(), device="cpu")
    pad = int(agent.tok.pad_token_id or 0)
    vocab = min(int(agent.model.encoder.config.vocab_size), len(agent.tok))
    res = verify_runner(runner, agent.model.float().eval(), cases(3, ranges, vocab, pad), ranges, pad,
                        torch.device("cpu"), Rule(1e-4, 1.0, "fp32"))
    assert res.passed, res.reason
    assert res.cases["one_row"]["rows"] == 1
    # every case (one row, one option, odd lengths, padded rows) ran on the one graph the first call
    # traced, and that call took Inductor's output from the cache instead of compiling it
    first = {k: v for k, v in runner.stats.items() if k.startswith("first_call_") and k != "first_call_s"}
    assert first == {"first_call_dynamo_graphs": 1, "first_call_fxgraph_cache_hit": 1,
                     "first_call_fxgraph_cache_miss": 0, "first_call_autograd_cache_hit": 1,
                     "first_call_autograd_cache_miss": 0}, first
    # what the build checks before it ships the artifact: a fresh process with empty caches hits it
    fresh = check_in_fresh_process(tmp_path / "compile", even_head_ckpt, "cpu")
    assert fresh["first_call_fxgraph_cache_hit"] == 1 and fresh["first_call_fxgraph_cache_miss"] == 0
    # laya's agent calls the forward under bf16 autocast on CUDA: that must not compile a second graph
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    case = cases(3, ranges, vocab, pad)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runner(*case.batch)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_cache_compiled_with_other_options_is_refused(demo_ckpt, tmp_path):
    import laya

    from laya_aot.kinds.inductor_cache import CompileRunner

    art = tmp_path / "compile"
    art.mkdir()
    info = {"options": {"dynamic": True}, "dtype": "fp32", "action_head_dtype": "fp32"}
    (art / INFO_FILE).write_text(json.dumps(info))
    (art / CACHE_FILE).write_bytes(b"")
    agent = laya.load(str(demo_ckpt), device="cpu")
    try:
        CompileRunner(art, agent.model, device="cpu")
    except ValueError as e:
        assert "rebuild the bundle" in str(e) and "'dynamic': True" in str(e)
    else:
        raise AssertionError("a cache compiled with other options was loaded")



@pytest.mark.slow  # compiles with Inductor, and again in a fresh process
def test_a_cache_saved_under_other_inductor_config_fails_the_fresh_process_check(demo_ckpt, tmp_path):
    # what AOTInductor packaging did to the build process (aot_inductor.metadata filled in place): the
    # saved graphs carry a key no fresh process computes, so the runtime would compile from scratch
    import laya

    agent = laya.load(str(demo_ckpt), device="cpu")
    with torch._inductor.config.patch({"aot_inductor.metadata": {"AOTI_DEVICE_KEY": "cpu"}}):
        build_cache(agent, tmp_path / "compile", Ranges(1, 8, 16, 256, 2, 64), "fp32", "fp32", device="cpu")
    with pytest.raises(RuntimeError, match="did not serve a fresh process"):
        check_in_fresh_process(tmp_path / "compile", demo_ckpt, "cpu")


# ---- the precompiled function (format `precompiled`): what the build ships where torch can precompile ----

# The serving side in a fresh process, as the loader drives it (kinds.get("compile").load with laya's module):
# every verification case against eager fp32 within the fp32 rule, and what the process traced and compiled from
# before the load to after the last case. mode "recompile" stands in for a broken load that compiles the module
# again (torch.compile in place of the saved function): the same count must see it.
CHILD = r'''
import json, sys
from pathlib import Path

import torch

from laya_aot import kinds, laya_internals as laya_api
from laya_aot.kinds.inductor_cache import COMPILE_KEYS, INFO_FILE, compile_counters, no_mha_fastpath
from laya_aot.padding import Ranges
from laya_aot.numerics.tolerance import Rule
from laya_aot.verification import cases, verify_runner

art_dir, ckpt, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
agent = laya_api.eager_agent(ckpt, device="cpu")
start = compile_counters()
runner = kinds.get("compile").load(art_dir, None, kinds.LoadEnv(device="cpu", model=agent.model))
if mode == "recompile":
    again = torch.compile(runner._module, fullgraph=True)

    def compiled(module, *batch):
        with no_mha_fastpath():
            return again(*batch)
    runner._fn = compiled
info = json.loads((art_dir / INFO_FILE).read_text())
ranges = Ranges.from_dict(info["ranges"] if "ranges" in info else json.loads(sys.argv[4]))  # a saved cache has none
pad = int(agent.tok.pad_token_id or 0)
vocab = min(int(agent.model.encoder.config.vocab_size), len(agent.tok))
model = agent.model.float().eval()
res = verify_runner(runner, model, cases(3, ranges, vocab, pad), ranges, pad, torch.device("cpu"),
                    Rule(1e-4, 1.0, "fp32"))
end = compile_counters()
print("RESULT " + json.dumps({"passed": res.passed, "reason": res.reason, "one_row": res.cases["one_row"]["rows"],
                              "compiles": {k: end[k] - start[k] for k in COMPILE_KEYS}, "stats": runner.stats}))
'''


def _fresh_child(art_dir, ckpt, mode: str, ranges: Optional[Ranges] = None) -> dict:
    import subprocess
    import sys

    extra = [json.dumps(ranges.as_dict())] if ranges else []
    p = subprocess.run([sys.executable, "-c", CHILD, str(art_dir), str(ckpt), mode] + extra, capture_output=True,
                       text=True, timeout=600)
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def precompiled(even_head_ckpt, tmp_path_factory):
    """The precompiled function of the even-head checkpoint, built as the build stage builds it (on the CPU here),
    with Dynamo unable to trace the fused encoder-layer op, as torch 2.11's cannot."""
    import laya

    from laya_aot.kinds.inductor_cache import build_precompiled

    agent = laya.load(str(even_head_ckpt), device="cpu")
    ranges = Ranges(1, 8, 16, int(agent.cfg.get("max_len", 256)), 2, 64)
    out = tmp_path_factory.mktemp("precompiled") / "compile"
    mp = pytest.MonkeyPatch()
    mp.setattr(torch, "_transformer_encoder_layer_fwd", _untraceable)
    try:
        facts = build_precompiled(agent, out, ranges, "fp32", "fp32", device="cpu")
    finally:
        mp.undo()
        torch._dynamo.reset()
    return out, facts, ranges


@pytest.mark.slow  # compiles with Inductor, then loads in fresh processes
def test_a_precompiled_function_serves_a_fresh_process_with_no_trace_and_no_compile(precompiled, even_head_ckpt):
    from laya_aot.kinds.inductor_cache import PRECOMPILED, PRECOMPILED_FILE

    out, facts, _ = precompiled
    info = json.loads((out / INFO_FILE).read_text())
    assert info["format"] == facts["format"] == PRECOMPILED
    assert (out / PRECOMPILED_FILE).stat().st_size == facts["bytes"]
    assert not (out / CACHE_FILE).exists()
    got = _fresh_child(out, even_head_ckpt, "load")
    # (a) every case, one row and one option included, within the fp32 rule the build verifies with
    assert got["passed"], got["reason"]
    assert got["one_row"] == 1
    # (b) nothing traced or compiled from the load to the last answer, and the runner says so itself
    assert got["compiles"] == {k: 0 for k in got["compiles"]}, got["compiles"]
    assert got["stats"]["format"] == PRECOMPILED and got["stats"]["compiles_since_load"] == 0


@pytest.mark.slow  # compiles with Inductor in a fresh process
def test_the_zero_compile_count_sees_a_load_that_compiles_again(precompiled, even_head_ckpt):
    # the mutation check of the test above: the same child and count, with the load broken into a torch.compile
    out, _, _ = precompiled
    got = _fresh_child(out, even_head_ckpt, "recompile")
    assert got["passed"], got["reason"]
    assert got["compiles"]["dynamo_graphs"] >= 1 and got["stats"]["compiles_since_load"] >= 1, got


@pytest.mark.slow  # compiles with Inductor, then checks in a fresh process
def test_the_build_check_accepts_the_precompiled_function_and_a_fresh_process_runs_it(precompiled, even_head_ckpt):
    from laya_aot.kinds.inductor_cache import check_in_fresh_process

    out, _, _ = precompiled
    fresh = check_in_fresh_process(out, even_head_ckpt, "cpu")
    assert fresh["compiles_since_load"] == 0 and fresh["max_abs_prob"] <= 1e-3
    assert all(fresh["fresh_" + k] == 0 for k in ("dynamo_graphs", "aot_autograd_traces", "inductor_lowerings"))


@pytest.mark.slow  # compiles with Inductor (the fixture)
def test_a_batch_outside_the_saved_guards_is_one_error_never_a_recompile(precompiled, even_head_ckpt):
    import laya

    from laya_aot.kinds.inductor_cache import PrecompiledRunner, compile_counters

    out, _, ranges = precompiled
    agent = laya.load(str(even_head_ckpt), device="cpu")
    runner = PrecompiledRunner(out, agent.model, device="cpu")
    case = cases(3, ranges, 100, 0)[0].batch
    before = compile_counters()
    with pytest.raises(ValueError, match="saved guards refuse"):  # int32 ids: a dtype the function was not made for
        runner(case[0].int(), *case[1:])
    too_long = tuple(torch.cat([t] * 40, 1) if t.dim() == 2 and i < 2 else t for i, t in enumerate(case))
    with pytest.raises(ValueError, match="outside the precompiled function's ranges"):
        runner(*too_long)
    assert compile_counters() == before


@pytest.mark.slow  # compiles with Inductor (the fixture)
def test_the_artifact_needs_its_exact_build_and_elsewhere_is_refused_naming_the_fix(precompiled):
    from dataclasses import replace

    from laya_aot.kinds.base import native_needs
    from laya_aot.kinds.inductor_cache import precompiled_needs
    from laya_aot.kinds.usable import reject_reason
    from laya_aot.manifest import Artifact
    from laya_aot.variant import current_machine

    _, facts, _ = precompiled
    here = current_machine("cpu")
    needs = precompiled_needs(native_needs(here, "cpu"), facts["system"])
    assert (needs.torch_build, needs.python_build) == (torch.__version__, here.python_build)
    assert needs.triton is None and needs.gpu_name is None  # torch checks those on a GPU only
    art = Artifact(name="compile-cpu", kind="compile", status="verified", device="cpu", needs=needs, dtype="fp32")
    assert reject_reason(art, here, "cpu", "fp32") is None
    # (c) the same artifact from another torch build: refused from the manifest, one reason naming the fix
    other = replace(art, needs=replace(needs, torch_build="2.11.0+cu130"))
    why = reject_reason(other, here, "cpu", "fp32")
    assert why and "torch 2.11.0+cu130, this process has %s" % torch.__version__ in why
    assert "rebuild the compile route" in why and ";" not in why.split("(")[0]
    # (d) and from the packages whose code it traced: transformers 5.25 brings `kernels`, whose wrappers a process
    # without it cannot load (ModuleNotFoundError deep in torch's loader before this check)
    from laya_aot.variant import traced_packages

    assert needs.traced_packages == traced_packages() and needs.traced_packages.startswith("laya==")
    without = replace(art, needs=replace(needs, traced_packages=_set_version(needs.traced_packages, "kernels", "none")))
    why = reject_reason(without, replace(here, traced_packages=_set_version(needs.traced_packages, "kernels",
                                                                                "0.19.1")), "cpu", "fp32")
    assert why == ("a precompiled function runs only with the packages whose code it traced (kernels none, this "
                   "process has 0.19.1): rebuild the compile route with this process's packages (`laya-aot build` "
                   "here)")


def _set_version(packages: str, name: str, version: str) -> str:
    return " ".join("%s==%s" % (n, version if n == name else v) for n, v in (p.split("==") for p in packages.split()))


def _compile_misfit(needs, machine):
    """Why `machine` cannot run a compile artifact needing `needs`: the compile kind's own need (`Kind.misfit`),
    else the shared facts, as selection asks."""
    from laya_aot.kinds.usable import machine_misfit
    from laya_aot.manifest import Artifact

    return machine_misfit(Artifact(name="compile", kind="compile", status="verified", device=needs.device,
                                   needs=needs), machine)


def test_a_gpu_artifact_needs_the_gpu_name_and_triton_it_was_compiled_with():
    from dataclasses import replace

    from laya_aot.manifest import Needs
    from laya_aot.variant import Machine

    needs = Needs(device="cuda", torch="2.11.0", cxx11_abi=True, gpu_arch="sm_90", cuda="13.0", machine="x86_64",
                  os="linux", torch_build="2.11.0+cu130", python_build="3.12.3", triton="3.5", gpu_name="NVIDIA H200")
    h200 = Machine(torch="2.11.0", cxx11_abi=True, cpu_isa="AVX512", cuda="13.0", gpu_arch="sm_90", machine="x86_64",
                   os="linux", python="3.12", torch_build="2.11.0+cu130", python_build="3.12.3", triton="3.5",
                   gpu_name="NVIDIA H200")
    assert _compile_misfit(needs, h200) is None
    h100 = replace(h200, gpu_name="NVIDIA H100 80GB HBM3")
    assert _compile_misfit(needs, h100) == (
        "a precompiled function runs only on the exact build it was compiled on (GPU NVIDIA H200, this process has "
        "NVIDIA H100 80GB HBM3): rebuild the compile route with this machine's torch (`laya-aot build` here)")
    why = _compile_misfit(needs, replace(h200, torch="2.13.0", torch_build="2.13.0+cu130", triton="3.9"))
    assert "torch 2.11.0+cu130, this process has 2.13.0+cu130; triton 3.5, this process has 3.9" in why
    assert "built for torch" not in why  # one reason: the exact build's, not the minor version's as well
    # an artifact without those fields (every bundle built before) is compared as before
    unbound = replace(needs, torch_build=None, python_build=None, triton=None, gpu_name=None)
    assert _compile_misfit(unbound, h100) is None


def test_the_exact_build_fields_are_read_and_checked_by_the_manifest_reader():
    import copy
    from pathlib import Path

    from laya_aot import kinds
    from laya_aot.manifest import Bundle

    sample = json.loads((Path(__file__).parent.parent / "shared" / "demo_manifest.json").read_text())
    old = copy.deepcopy(sample)
    for art in old["artifacts"]:  # a bundle written before the fields existed
        for key in ("torch_build", "python_build", "triton", "gpu_name"):
            art["needs"].pop(key, None)
    assert all(a.needs.torch_build is None and not a.invalid for a in Bundle.from_dict(old, kinds.NAMES).artifacts)
    sample["artifacts"][1]["needs"].update(torch_build="2.11.0+cu130", gpu_name="NVIDIA H200", triton="3.5")
    read = Bundle.from_dict(sample, kinds.NAMES).artifacts[1]
    assert (read.needs.torch_build, read.needs.gpu_name, read.invalid) == ("2.11.0+cu130", "NVIDIA H200", None)
    sample["artifacts"][1]["needs"]["torch_build"] = "not a version"
    assert "needs.torch_build" in Bundle.from_dict(sample, kinds.NAMES).artifacts[1].invalid


# ---- the fallback: where torch cannot precompile, or its function fails the fresh-process check ----

def _compile_stage(ckpt: Path, staging: Path):
    """The compile stage as the pipeline runs it (`_run_stage`: its entry, its artifact), past its CUDA gate on
    the CPU (`build_artifact`); returns (stage entry, artifact, artifact directory, ranges)."""
    import laya

    from laya_aot.config import compose
    from laya_aot.kinds.base import BuildContext, Exported
    from laya_aot.kinds.inductor_cache import KIND, STAGE, build_artifact
    from laya_aot.pipeline.stages import _run_stage
    from laya_aot.variant import current_machine

    agent = laya.load(str(ckpt), device="cpu")
    ranges = Ranges(1, 8, 16, int(agent.cfg.get("max_len", 256)), 2, 64)
    staging.mkdir(parents=True)
    cfg = compose(["checkpoint.path=%s" % ckpt, "output_dir=%s" % staging.parent])
    ctx = BuildContext(cfg=cfg, ckpt=Path(ckpt), info={}, staging=staging, machine=current_machine("cpu"),
                       device="cpu", dtypes=["fp32"], agent=agent)
    ctx.exported = Exported(program=None, dtype="fp32", ranges=ranges)
    try:
        _run_stage(ctx, STAGE, lambda c: build_artifact(c, c.exported), False, True, lambda rec: None, KIND, "fp32")
    finally:
        torch._dynamo.reset()
    (entry,) = ctx.stages
    (art,) = ctx.artifacts
    assert entry["status"] == "ok" and art.path, entry  # a failed stage records an artifact without a path
    return entry, art, staging / art.path, ranges


def _assert_ships_the_saved_cache(entry, art, out, why: str) -> None:
    """What the stage must leave where the precompile failed: an ok stage and a built artifact in the cache
    format, the reason in the stage entry and the artifact's facts, and a cache a fresh process hit."""
    from laya_aot.kinds.inductor_cache import INDUCTOR_CACHE, PRECOMPILED_FILE

    assert entry["status"] == "ok" and art.status == "built", entry
    assert entry["format"] == art.details["format"] == INDUCTOR_CACHE, entry
    assert why in entry["precompile_failed"] and entry["precompile_failed"] == art.details["precompile_failed"]
    assert why in entry["summary"]
    assert json.loads((out / INFO_FILE).read_text())["format"] == INDUCTOR_CACHE
    assert (out / CACHE_FILE).stat().st_size == art.details["bytes"] > 0
    assert not (out / PRECOMPILED_FILE).exists()  # nothing of the failed precompile is left beside it
    # nor in it: the one graph's Inductor and AOTAutograd entries, each whether this compile made it or hit it
    # (build_cache's own record of artifacts; the process-wide one saved the precompile's bundled entry too, and,
    # after an earlier save of the same graph in the process, left this graph's AOTAutograd entry out)
    from torch.compiler._cache import CacheArtifactManager

    saved = CacheArtifactManager.deserialize((out / CACHE_FILE).read_bytes())
    assert {k: len(v) for k, v in saved.items()} == {"inductor": 1, "aot_autograd": 1}, saved
    assert art.needs.torch_build is None  # a saved cache is not bound to the exact build
    fresh = art.details["fresh_process"]
    assert fresh["first_call_fxgraph_cache_hit"] >= 1 and fresh["first_call_fxgraph_cache_miss"] == 0, fresh


_AOT_FAILS = "aot_compile stands in for torch 2.11's failure"


def _aot_compile_fails(*args, **kwargs):
    raise RuntimeError(_AOT_FAILS)


@pytest.fixture(scope="module")
def precompile_raised(even_head_ckpt, tmp_path_factory):
    """The compile stage with torch's precompile raising (`aot_compile_fullgraph`, what the `aot_compile` of
    the build's torch.compile calls): (stage entry, artifact, artifact directory, ranges)."""
    import torch._dynamo.aot_compile as aot

    mp = pytest.MonkeyPatch()
    mp.setattr(aot, "aot_compile_fullgraph", _aot_compile_fails)
    try:
        return _compile_stage(even_head_ckpt, tmp_path_factory.mktemp("fallback") / "staging")
    finally:
        mp.undo()


@pytest.mark.slow  # compiles with Inductor, then loads in fresh processes
def test_a_precompile_that_raises_ships_the_saved_cache_and_says_why(precompile_raised, even_head_ckpt):
    # catches: the build letting the precompile's error fail the stage (no `except` around build_precompiled),
    # dropping the reason from the stage entry (`record["precompile_failed"]`), or shipping no working cache
    entry, art, out, ranges = precompile_raised
    _assert_ships_the_saved_cache(entry, art, out, "RuntimeError: " + _AOT_FAILS)
    # the runtime's loader in a fresh process: every case, one row included, within the fp32 rule
    got = _fresh_child(out, even_head_ckpt, "load", ranges)
    assert got["passed"], got["reason"]
    assert got["one_row"] == 1 and got["stats"]["format"] == "inductor_cache", got
    assert got["stats"]["first_call_fxgraph_cache_miss"] == 0 and got["compiles"]["inductor_lowerings"] == 0, got


@pytest.mark.slow  # loads a saved cache in a fresh process (the fixture compiles with Inductor)
def test_an_older_compile_json_without_format_loads_the_saved_cache(precompile_raised, even_head_ckpt, tmp_path):
    # every bundle built before precompiled functions: compile.json has no `format`. Catches load_runner taking
    # a missing format for PRECOMPILED (the child would then fail to open precompiled.bin)
    _, _, out, ranges = precompile_raised
    old = tmp_path / "compile"
    shutil.copytree(out, old)
    info = json.loads((old / INFO_FILE).read_text())
    del info["format"]
    (old / INFO_FILE).write_text(json.dumps(info))
    got = _fresh_child(old, even_head_ckpt, "load", ranges)
    assert got["passed"], got["reason"]
    assert got["stats"]["format"] == "inductor_cache" and got["stats"]["first_call_fxgraph_cache_miss"] == 0, got


class _ChildReportsACompile:
    """`subprocess` as check_in_fresh_process calls it, with the fresh process's report on a precompiled function
    changed to one compile since the load (what a torch whose loaded function traces again would report); the
    report on a saved cache is left as the child wrote it."""

    def __init__(self):
        self.changed = 0

    def run(self, *args, **kwargs):
        import subprocess

        from laya_aot.kinds.inductor_cache import FRESH_MARK, PRECOMPILED

        p = subprocess.run(*args, **kwargs)
        lines = []
        for line in p.stdout.splitlines():
            if line.startswith(FRESH_MARK):
                stats = json.loads(line[len(FRESH_MARK):])
                if stats.get("format") == PRECOMPILED:
                    stats.update(compiles_since_load=1, fresh_dynamo_graphs=1)
                    self.changed += 1
                line = FRESH_MARK + json.dumps(stats)
            lines.append(line)
        p.stdout = "\n".join(lines) + "\n"
        return p


@pytest.mark.slow  # compiles with Inductor twice (the precompile, then the cache), each checked in a fresh process
def test_a_precompiled_function_that_fails_the_fresh_process_check_ships_the_saved_cache(even_head_ckpt, tmp_path,
                                                                                         monkeypatch):
    # the precompile succeeds in the build process and its check rejects it, so the cache is compiled after a
    # precompile in the same process (torch 2.11's likely case). Catches: the check's result not reaching the
    # fallback (check_in_fresh_process outside the `try`), the precompiled function left beside the cache, a
    # check that ignores the compile count, and a cache that the precompile's leftovers stop from serving
    from laya_aot.kinds import inductor_cache

    child = _ChildReportsACompile()
    monkeypatch.setattr(inductor_cache, "subprocess", child)
    entry, art, out, ranges = _compile_stage(even_head_ckpt, tmp_path / "staging")
    assert child.changed == 1, "the precompiled function was never checked"
    _assert_ships_the_saved_cache(entry, art, out, "traced or compiled in a fresh process")
    monkeypatch.undo()
    got = _fresh_child(out, even_head_ckpt, "load", ranges)
    assert got["passed"], got["reason"]
    assert got["stats"]["format"] == "inductor_cache" and got["stats"]["first_call_fxgraph_cache_miss"] == 0, got


def test_without_the_precompile_api_the_reason_names_what_is_missing(monkeypatch):
    # catches precompile_unavailable passing a torch without load_compiled_function (the build would then fail
    # inside torch rather than say why)
    from laya_aot.kinds.inductor_cache import precompile_unavailable

    assert precompile_unavailable() is None  # this torch has it (2.13)
    monkeypatch.delattr(torch.compiler, "load_compiled_function")
    assert precompile_unavailable() == "torch %s has no torch.compiler.load_compiled_function" % torch.__version__


def test_load_runner_reads_a_missing_format_as_the_saved_cache(tmp_path, monkeypatch):
    # the dispatch alone, without compiling: catches a default other than INDUCTOR_CACHE in load_runner
    from laya_aot.kinds import inductor_cache

    monkeypatch.setattr(inductor_cache, "CompileRunner", lambda *a: "cache")
    monkeypatch.setattr(inductor_cache, "PrecompiledRunner", lambda *a: "precompiled")
    for info, runner in (({}, "cache"), ({"format": "inductor_cache"}, "cache"), ({"format": "precompiled"},
                                                                                   "precompiled")):
        (tmp_path / INFO_FILE).write_text(json.dumps(info))
        assert inductor_cache.load_runner(tmp_path, None, "cpu") == runner, info


def test_saved_guards_leave_out_type_checks_on_classes_made_inside_a_function():
    """transformers 5.25 with `kernels` gives each ModernBERT attention an instance of a class made inside a
    function; torch refuses to save a type guard on it, which cost the compile route its precompiled function."""
    from types import SimpleNamespace

    from laya_aot.kinds.inductor_cache import _saved_guards

    def make():
        class Local:
            pass
        return Local()

    def entry(value, kind="TYPE_MATCH"):
        return SimpleNamespace(name="L['self']._x", has_value=True, value=value, guard_type=kind,
                               derived_guard_types=(), is_global=False, orig_guard=None)

    # a local class's type guard goes; a module-level class's (int) and other guard kinds stay
    assert _saved_guards([entry(make()), entry(3), entry(make(), "TENSOR_MATCH")]) == [False, True, True]


def test_a_precompiled_function_needs_the_packages_it_traced():
    """laya, transformers and kernels as the build recorded them (`Needs.traced_packages`); an artifact without the
    field (an older bundle) is not bound to them; a machine that differs is refused with one reason and the fix."""
    from dataclasses import replace

    from laya_aot.manifest import Needs
    from laya_aot.variant import Machine

    built = "laya==0.4.15 transformers==5.25.0 kernels==0.19.1"
    needs = Needs(device="cpu", torch="2.13.0", torch_build="2.13.0+cpu", python_build="3.11.7", traced_packages=built)
    here = Machine(torch="2.13.0", cxx11_abi=True, cpu_isa="AVX512", cuda=None, gpu_arch=None, machine="x86_64",
                   os="linux", python="3.11", torch_build="2.13.0+cpu", python_build="3.11.7", traced_packages=built)
    assert _compile_misfit(needs, here) is None
    older = replace(here, traced_packages="laya==0.4.15 transformers==5.24.0 kernels==none")
    assert _compile_misfit(needs, older) == (
        "a precompiled function runs only with the packages whose code it traced (transformers 5.25.0, this process "
        "has 5.24.0; kernels 0.19.1, this process has none): rebuild the compile route with this process's packages "
        "(`laya-aot build` here)")
    assert _compile_misfit(replace(needs, traced_packages=None), older) is None
    # another torch build is the first reason, alone
    assert "exact build" in _compile_misfit(needs, replace(older, torch_build="2.13.1+cpu"))
