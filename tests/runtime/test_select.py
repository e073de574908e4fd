"""Selection without loading anything: variants, compatibility reasons, ranking."""
from __future__ import annotations

from dataclasses import replace

import pytest

from laya_aot import kinds
from laya_aot.manifest import Artifact, Needs, VerifyResult
from laya_aot.runtime.select import MIX_TIE, START_TIE, rank, reject_reason, start_tie_reason
from laya_aot.variant import Machine, isa_satisfies, mismatch, torch_tag

CPU = Machine(torch="2.13.0", cxx11_abi=True, cpu_isa="AVX512", cuda=None, gpu_arch=None, machine="x86_64",
              os="linux", python="3.11")
H200 = replace(CPU, torch="2.11.0", cuda="13.0", gpu_arch="sm_90")


def test_variant_strings_name_what_an_artifact_needs():
    assert kinds.get("aoti").variant(CPU, "cpu") == "torch213-cxx11-cpu-avx512-x86_64-linux"
    assert kinds.get("aoti").variant(H200, "cuda") == "torch211-cxx11-cu130-sm_90-x86_64-linux"
    assert kinds.get("onnx").variant(CPU, "cpu") == "onnx-any"
    assert kinds.get("tilelang").variant(replace(H200, gpu_arch="sm_90a"), "cuda") == "cu130-sm_90a-x86_64-linux"
    assert torch_tag("2.14.1+cu130") == "torch214"


def test_isa_ladder():
    assert isa_satisfies("AVX512", "AVX2") and not isa_satisfies("AVX2", "AVX512")
    assert isa_satisfies("AVX2", "DEFAULT") and not isa_satisfies("VSX", "AVX2")


@pytest.mark.parametrize("needs, machine, expect", [
    ({"device": "cpu", "torch": "2.12.0"}, CPU, "built for torch 2.12.0"),
    ({"device": "cpu", "cxx11_abi": False}, CPU, "cxx11_abi=False"),
    ({"device": "cpu", "cpu_isa": "AVX512"}, replace(CPU, cpu_isa="AVX2"), "needs CPU instructions AVX512"),
    ({"device": "cuda", "gpu_arch": "sm_90"}, CPU, "needs a CUDA GPU"),
    ({"device": "cuda", "gpu_arch": "sm_80", "cuda": "13.0"}, H200, "compiled for sm_80, this GPU is sm_90"),
    ({"device": "cuda", "gpu_arch": "sm_90", "cuda": "12.8"}, H200, "built against CUDA 12.8"),
    ({"device": "cpu", "machine": "aarch64"}, CPU, "built for aarch64"),
])
def test_mismatch_says_why(needs, machine, expect):
    assert expect in mismatch(Needs(**needs), machine)


def test_matching_machine_has_no_mismatch():
    assert mismatch(Needs(device="cuda", gpu_arch="sm_90a", cuda="13.0", torch="2.11.0"), H200) is None
    assert mismatch(Needs(device="cpu", torch="2.13.1", cpu_isa="AVX2", cxx11_abi=True), CPU) is None


def _entry(name, kind, status="verified", lat=None, device="cpu", dtype="fp32", **kw):
    return Artifact(name=name, kind=kind, status=status, needs=Needs(device=device), device=device, dtype=dtype,
                    latency_ms={device: {"1x128x4": lat}} if lat is not None else {}, **kw)


def test_reject_reasons_from_the_manifest():
    assert "failed verification" in reject_reason(_entry("a", "aoti", "failed_verification",
                                                         verify=VerifyResult(False, "over tolerance")), CPU, "cpu",
                                                  "fp32")
    assert "build failed" in reject_reason(_entry("a", "aoti", "build_failed", error="boom"), CPU, "cpu", "fp32")
    assert "not a runtime artifact" in reject_reason(_entry("p", "exported_program"), CPU, "cpu", "fp32")
    assert "ONNX Runtime runs on the CPU" in reject_reason(_entry("o", "onnx"), H200, "cuda", "fp16")
    assert reject_reason(_entry("a", "aoti"), CPU, "cpu", "fp32") is None
    # laya serves this agent in another dtype than the artifact computes in: refused with the fix
    gpu = _entry("g", "aoti", device="cuda", dtype="bf16")
    why = reject_reason(gpu, H200, "cuda", "fp16")
    assert "computes in bf16 and this agent serves in fp16" in why and "target.dtypes=[fp16]" in why
    assert reject_reason(gpu, H200, "cuda", "bf16") is None


def test_rank_by_measured_latency_then_fixed_order():
    es = [_entry("onnx", "onnx", lat=2.0), _entry("aoti", "aoti", lat=1.0), _entry("tl", "tilelang")]
    assert [e.name for e in rank(es, "cpu")[0]] == ["aoti", "onnx", "tl"]
    es = [_entry("onnx", "onnx"), _entry("compile", "compile"), _entry("aoti", "aoti"), _entry("tl", "tilelang")]
    assert [e.name for e in rank(es, "cpu")[0]] == ["tl", "aoti", "compile", "onnx"]


def test_a_tie_on_the_mix_goes_to_the_artifact_that_starts_faster_here():
    tl, aoti = _entry("tl", "tilelang", lat=1.00), _entry("aoti", "aoti", lat=1.03)
    onnx = _entry("onnx", "onnx", lat=2.0)
    es = [tl, aoti, onnx]
    assert [e.name for e in rank(es, "cpu")[0]] == ["tl", "aoti", "onnx"]          # no start recorded: the mix
    starts = {"tl": 21.0, "aoti": 4.2, "onnx": 1.0}
    assert [e.name for e in rank(es, "cpu", starts=starts)[0]] == ["aoti", "tl", "onnx"]   # onnx: not a tie
    assert "starts more than %d%% faster here (4.20 s against 21.00 s)" % round(START_TIE * 100) \
        in start_tie_reason(aoti, es, "cpu", starts)
    assert start_tie_reason(tl, es, "cpu", {"tl": 21.0}) is None      # the mix put it first
    # beyond the tie, the mix decides whatever the start costs
    slower = _entry("aoti", "aoti", lat=1.0 * (1 + MIX_TIE) + 0.01)
    assert [e.name for e in rank([tl, slower], "cpu", starts=starts)[0]] == ["tl", "aoti"]
    # an artifact never started here goes after one whose start is known, within the tie
    assert [e.name for e in rank([tl, aoti], "cpu", starts={"aoti": 30.0})[0]] == ["aoti", "tl"]


def test_recorded_starts_within_their_noise_do_not_switch_the_artifact():
    # catches: a tie-break that follows every recorded start (each start re-records the artifact it served, a
    # little slower or quicker with the machine's load, so a service, or two workers of one server, switched
    # artifacts from one start to the next), or a leader that is not the same for the same figures
    tl, aoti, onnx = _entry("tl", "tilelang", lat=1.00), _entry("aoti", "aoti", lat=1.02), _entry("o", "onnx", lat=1.04)
    first = lambda starts: rank([tl, aoti, onnx], "cpu", starts=starts)[0][0].name  # noqa: E731
    assert first({"tl": 1.0, "aoti": 1.0 * (1 - START_TIE) + 0.01}) == "tl"       # quicker, within the noise
    assert first({"tl": 1.0, "aoti": 1.0 * (1 - START_TIE) - 0.01}) == "aoti"     # quicker beyond it
    # the served artifact's start recorded again, a little slower each time: it keeps the lead
    starts = {"tl": 2.0, "aoti": 1.0}
    for again in (1.05, 1.1, 1.2, 1.55):
        starts["aoti"] = again
        assert first(starts) == "aoti", starts
    starts["aoti"] = 2.0 * (1 - START_TIE) + 0.01                                 # now within the noise of tl's
    assert first(starts) == "tl"
    # a follower a little quicker than the leader does not take over from it; the walk is in mix order
    assert first({"tl": 2.0, "aoti": 1.0, "o": 0.9}) == "aoti"
    assert first({"tl": 2.0, "aoti": 1.0, "o": 0.7}) == "o"
    assert [e.name for e in rank([tl, aoti, onnx], "cpu", starts={"o": 0.5})[0]] == ["o", "tl", "aoti"]


def test_start_costs_are_recorded_per_artifact_and_machine(tmp_path, monkeypatch):
    from laya_aot.runtime import start_costs

    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path))
    a, b = _entry("aoti", "aoti", lat=1.0), _entry("tl", "tilelang", lat=1.0)
    assert start_costs.known([a, b], CPU, "cpu") == {}
    start_costs.record(a, CPU, "cpu", 3.25)
    assert start_costs.known([a, b], CPU, "cpu") == {"aoti": 3.25}
    assert start_costs.known([a], H200, "cpu") == {} and start_costs.known([a], CPU, "cuda") == {}
    # another build's entry of the same name is another artifact
    assert start_costs.known([replace(a, sha256={"model.pt2": "0" * 64})], CPU, "cpu") == {}


def test_prefer_keeps_one_kind_and_says_why_for_the_rest():
    es = [_entry("onnx", "onnx", lat=0.5), _entry("aoti", "aoti", lat=1.0)]
    order, skipped = rank(es, "cpu", prefer="aoti")
    assert [e.name for e in order] == ["aoti"]
    assert skipped == [("onnx", "not the preferred kind (prefer='aoti')")]
    with pytest.raises(ValueError, match="not an artifact kind"):
        rank(es, "cpu", prefer="tensorrt")
