"""What an install fixes: the artifacts this process's software refuses, each named with the fix, apart from those
the machine itself cannot run (`usable.refused_for_software`, `variant.with_software_of`)."""
from __future__ import annotations

from dataclasses import replace

from laya_aot.kinds.usable import Here, refused_for_software
from laya_aot.manifest import Artifact, Needs
from laya_aot.variant import Machine, mismatch, with_software_of

# a service whose `pip install` picked a newer torch than the build's
CPU = Machine(torch="2.14.1", cxx11_abi=True, cpu_isa="AVX512", cuda=None, gpu_arch=None, machine="x86_64",
              os="linux", python="3.11", torch_build="2.14.1+cu130", python_build="3.11.7")
BUILT = dict(torch="2.13.0", cxx11_abi=True, cpu_isa="AVX512", machine="x86_64", os="linux")


def _art(name: str, kind: str, device: str = "cpu", **needs) -> Artifact:
    return Artifact(name=name, kind=kind, status="verified", needs=Needs(device=device, **needs), device=device,
                    dtype="fp32")


def test_another_torch_is_refused_with_the_install_that_fixes_it():
    why = mismatch(Needs(device="cpu", **BUILT), CPU)
    assert why == ("built for torch 2.13.0, this process has torch 2.14.1: install the torch it was built with "
                   "(`pip install torch==2.13.0`), or rebuild the bundle with this torch (`laya-aot build`)")
    assert mismatch(Needs(device="cpu", **dict(BUILT, torch="2.14.0")), CPU) is None   # a patch release: the same
    assert "torch==2.13.0`" in mismatch(Needs(device="cpu", torch="2.13.0+cpu"), CPU)   # no local label to install


def test_only_what_an_install_fixes_is_named():
    here = Here("cpu", "cpu", CPU, "fp32")
    arts = [_art("aoti-cpu", "aoti", **BUILT),
            _art("aoti-arm", "aoti", **dict(BUILT, machine="aarch64")),      # another machine as well
            _art("aoti-here", "aoti", **dict(BUILT, torch="2.14.0")),           # built with this torch: usable
            _art("aoti-sm90", "aoti", "cuda", torch="2.13.0", gpu_arch="sm_90", cuda="13.0"),   # needs a GPU
            _art("onnx-fp32", "onnx"),                                          # no torch of its own
            _art("exported_program-fp32", "exported_program", torch="2.13.0")]   # never serves
    got = refused_for_software(arts, here)
    assert [name for name, _ in got] == ["aoti-cpu"]
    assert "`pip install torch==2.13.0`" in got[0][1]
    # a bf16 package for an fp32 agent: another dtype, which no install changes
    assert refused_for_software([replace(arts[0], dtype="bf16")], here) == []


def test_the_software_of_a_build_leaves_the_hardware_as_it_is():
    built = with_software_of(CPU, Needs(device="cuda", torch="2.13.0+cu128", cuda="12.8", gpu_arch="sm_90",
                                        cxx11_abi=False))
    assert (built.torch, built.cxx11_abi) == ("2.13.0", False)
    assert built.cuda is None and built.gpu_arch is None and built.cpu_isa == CPU.cpu_isa   # no GPU here stays so


def test_what_a_kind_alone_needs_says_whether_an_install_fixes_it():
    """The compile kind's exact build (`Kind.misfit`): another torch build or Python is named with its fix, another
    GPU is not (no install changes it), whatever else the shared facts say."""
    gpu = replace(CPU, cuda="13.0", gpu_arch="sm_90", triton="3.5", gpu_name="NVIDIA H200")
    here = Here("cuda", "cuda", gpu, "bf16")
    exact = dict(torch="2.14.1", cuda="13.0", gpu_arch="sm_90", torch_build="2.14.1+cu130", python_build="3.11.7",
                 triton="3.5", gpu_name="NVIDIA H200")

    def compile_art(name: str, **changed) -> Artifact:
        return replace(_art(name, "compile", "cuda", **dict(exact, **changed)), dtype="bf16")

    arts = [compile_art("compile-here"), compile_art("compile-torch", torch_build="2.14.1+cu128"),
            compile_art("compile-python", python_build="3.11.4"), compile_art("compile-h100", gpu_name="NVIDIA H100"),
            compile_art("compile-torch-h100", torch_build="2.14.1+cu128", gpu_name="NVIDIA H100"),
            compile_art("compile-torch-sm80", torch_build="2.14.1+cu128", gpu_arch="sm_80")]
    got = dict(refused_for_software(arts, here))
    assert sorted(got) == ["compile-python", "compile-torch"]
    assert got["compile-torch"].startswith("a precompiled function runs only on the exact build it was compiled on "
                                           "(torch 2.14.1+cu128, this process has 2.14.1+cu130)")
