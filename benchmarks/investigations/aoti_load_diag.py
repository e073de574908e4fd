#!/usr/bin/env python3
"""One-shot AOTInductor load-crash triage (torch 2.11, x86-64, offline).

Usage:  python benchmarks/investigations/aoti_load_diag.py [--cpu-only] [--only NAME,NAME] [--out DIR]

The minimal reproducer for the AOTInductor load crash seen on the H200 host (issue 5).
Every variant runs in its own subprocess (a segfault kills only that case) with a
fresh TMPDIR + TORCHINDUCTOR_CACHE_DIR, so inductor caches AND the precompiled
headers (/tmp/torchinductor_$USER/precompiled_headers, keyed off tempfile.gettempdir())
are never reused between variants.  Results: DIR/summary.txt (+ per-case logs).
Loading is done in 4 stages so the last "STAGE" line says where it died:
  A dlopen(.so, RTLD_NOW|RTLD_LOCAL) via ctypes   -> static init / relocation / ISA
  B AOTInductorModelContainerCreateWithDevice      -> container ctor, constants
  C AOTInductorModelContainerRun (ctypes)          -> kernels / OpenMP / CUDA launch
  D torch._inductor.aoti_load_package + run        -> torch's own C++ loader
"""
import ctypes
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import zipfile

HERE = os.path.abspath(__file__)
PY = sys.executable


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120).stdout.strip()
    except Exception as e:  # noqa
        return f"<{e}>"


# --------------------------------------------------------------------------- child: build
def build(kind, device, pt2, cfg):
    import torch
    torch.manual_seed(0)
    if kind == "noweights":
        class M(torch.nn.Module):
            def forward(self, x):
                return (x + 1).relu() * 2
    else:
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.l1 = torch.nn.Linear(64, 64)
                self.l2 = torch.nn.Linear(64, 64)
            def forward(self, x):
                return self.l2(torch.nn.functional.gelu(self.l1(x))).softmax(-1)
    m = M().to(device).eval()
    x = torch.randn(8, 64, device=device)
    ep = torch.export.export(m, (x,))
    torch._inductor.aoti_compile_and_package(ep, package_path=pt2, inductor_configs=cfg)
    torch.save((x.cpu(), m(x).detach().cpu()), pt2 + ".io")
    print("BUILD OK", pt2, flush=True)


# --------------------------------------------------------------------------- child: staged load
def load(device, pt2, stages):
    import torch
    if device == "cuda":
        torch.cuda.init(); torch.zeros(1, device="cuda")
    x, ref = torch.load(pt2 + ".io")
    x = x.to(device)
    d = tempfile.mkdtemp(prefix="aoti_x_")
    zipfile.ZipFile(pt2).extractall(d)
    sos = sorted(p for p in glob.glob(f"{d}/**/*.so", recursive=True) if "aotinductor" in p)
    so = sos[0]
    print("SO", so, flush=True)
    print(sh(f"readelf -d {so} | grep -E 'NEEDED|RPATH|RUNPATH'"), flush=True)
    print("zmm-instrs:", sh(f"objdump -d --no-show-raw-insn {so} | grep -c zmm"),
          "ymm-instrs:", sh(f"objdump -d --no-show-raw-insn {so} | grep -c ymm"), flush=True)
    if "A" in stages:
        print("STAGE A dlopen ...", flush=True)
        lib = ctypes.CDLL(so, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        print("STAGE A OK", flush=True)
        maps = open("/proc/self/maps").read()
        libs = sorted({l.split()[-1] for l in maps.splitlines()
                       if any(k in l for k in ("gomp", "libomp", "iomp", "stdc++", "cudart", "libcuda.so", "libgcc_s"))})
        print("MAPPED:", *libs, sep="\n  ", flush=True)
    if "B" in stages:
        print("STAGE B create ...", flush=True)
        h = ctypes.c_void_p()
        f = lib.AOTInductorModelContainerCreateWithDevice
        f.restype = ctypes.c_int32
        f.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_char_p, ctypes.c_char_p]
        rc = f(ctypes.byref(h), 1, device.encode(), os.path.dirname(so).encode())
        print("STAGE B OK rc=", rc, flush=True)
    if "C" in stages and rc == 0:
        print("STAGE C run ...", flush=True)
        cap_get = ctypes.pythonapi.PyCapsule_GetPointer
        cap_get.restype, cap_get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        cap_new = ctypes.pythonapi.PyCapsule_New
        cap_new.restype, cap_new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        ins = [cap_get(c, None) for c in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors([x])]
        n = ctypes.c_size_t()
        lib.AOTInductorModelContainerGetNumOutputs(h, ctypes.byref(n))
        in_arr = (ctypes.c_void_p * len(ins))(*ins)
        out_arr = (ctypes.c_void_p * n.value)()
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream) if device == "cuda" else None
        run = lib.AOTInductorModelContainerRun
        run.restype = ctypes.c_int32
        rc = run(h, in_arr, len(ins), out_arr, n.value, stream, None)
        outs = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs([cap_new(p, None, None) for p in out_arr])
        if device == "cuda":
            torch.cuda.synchronize()
        print("STAGE C OK rc=", rc, "maxdiff=", (outs[0].cpu() - ref).abs().max().item(), flush=True)
    if "D" in stages:
        print("STAGE D aoti_load_package ...", flush=True)
        cm = torch._inductor.aoti_load_package(pt2)
        y = cm(x)
        if device == "cuda":
            torch.cuda.synchronize()
        print("STAGE D OK maxdiff=", (y.cpu() - ref).abs().max().item(), flush=True)


# --------------------------------------------------------------------------- child: JIT controls
def jit(device, cpp_wrapper):
    import torch
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).to(device)
    x = torch.randn(8, 64, device=device)
    opts = {"cpp_wrapper": True} if cpp_wrapper else {}
    y = torch.compile(m, options=opts)(x)
    if device == "cuda":
        torch.cuda.synchronize()
    print("JIT OK maxdiff=", (y - m(x)).abs().max().item(), flush=True)


# --------------------------------------------------------------------------- driver
class _Summary(list):
    """Appends each line to summary.txt as it comes, so a run cut short still reports what it saw."""

    def __init__(self, out):
        super().__init__()
        self.path = os.path.join(out, "summary.txt")
        open(self.path, "w").close()

    def append(self, line):
        super().append(line)
        with open(self.path, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)


def sig(rc):
    if rc is None:
        return "TIMEOUT"
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return "ok" if rc == 0 else f"exit {rc}"


def make_cxx_wrapper(root, real_cxx, march, extra):
    """A fake 'g++' (file name must contain g++ so inductor keeps its GCC flag set)."""
    d = os.path.join(root, "cxx_" + (march or "keep") + "_" + "".join(c for c in extra if c.isalnum()))
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, "g++")
    with open(p, "w") as f:
        f.write(f"#!{PY}\n"
                "import os, sys\n"
                f"MARCH, EXTRA, REAL = {march!r}, {extra.split()!r}, {real_cxx!r}\n"
                "a = [(('-march=' + MARCH) if (x == '-march=native' and MARCH) else x) for x in sys.argv[1:]]\n"
                "if len(a) > 1: a += EXTRA\n"
                "os.execv(REAL, [REAL] + a)\n")
    os.chmod(p, 0o755)
    return p


def main():
    cpu_only = "--cpu-only" in sys.argv
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else tempfile.mkdtemp(prefix="aoti_diag_")
    os.makedirs(out, exist_ok=True)
    real_cxx = shutil.which(os.environ.get("CXX", "g++")) or "g++"
    summary = _Summary(out)

    # ---- environment facts (cheap, decisive for several hypotheses)
    env = {
        "torch": sh(f"{PY} -c 'import torch;print(torch.__version__, torch.version.cuda, torch._C._GLIBCXX_USE_CXX11_ABI, torch.__file__)'"),
        "cxx": real_cxx, "cxx_version": sh(f"{real_cxx} --version | head -1"),
        "cxx_default_cxx11_abi": sh(f"echo '#include <string>' | {real_cxx} -x c++ -E -dM - | grep _GLIBCXX_USE_CXX11_ABI"),
        "march_native_resolves_to": sh(f"{real_cxx} -march=native -Q --help=target | grep -E '^ +-march=|-mavx512f |-mamx-tile |-mavx2 ' "),
        "cpuinfo_flags": sh("grep -m1 -o -w -E 'avx512f|avx512bw|avx512_bf16|amx_tile|amx_bf16|avx2|xsave|osxsave' /proc/cpuinfo | sort -u | tr '\\n' ' '"),
        "system_libgomp": sh(f"{real_cxx} -print-file-name=libgomp.so.1"),
        "torch_libgomp": sh(f"{PY} -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),\"lib\",\"libgomp.so.1\"))'"),
        "ld": sh("ld --version | head -1"), "glibc": sh("ldd --version | head -1"),
        "LD_PRELOAD": os.environ.get("LD_PRELOAD"), "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH"),
        "CUDA_HOME": os.environ.get("CUDA_HOME"), "gdb": shutil.which("gdb") or shutil.which("cuda-gdb")
        or (os.path.exists("/usr/local/cuda/bin/cuda-gdb") and "/usr/local/cuda/bin/cuda-gdb") or None,
    }
    env["torch_libgomp_versions"] = sh(f"objdump -T {env['torch_libgomp']} | grep -o 'GOMP_[0-9.]*' | sort -uV | tail -2 | tr '\\n' ' '")
    env["system_libgomp_versions"] = sh(f"objdump -T $(readlink -f {env['system_libgomp']}) | grep -o 'GOMP_[0-9.]*' | sort -uV | tail -2 | tr '\\n' ' '")
    summary.append("ENV " + json.dumps(env, indent=1))

    noarch = make_cxx_wrapper(out, real_cxx, "x86-64-v2", "")
    abi1 = make_cxx_wrapper(out, real_cxx, None, "-D_GLIBCXX_USE_CXX11_ABI=1")
    sys_gomp = os.path.realpath(env["system_libgomp"]) if os.path.exists(env["system_libgomp"]) else None

    # (name, device, model, inductor_configs, extra_env)
    NOPCH = {"aot_inductor.precompile_headers": False}
    variants = [
        ("cpu_noweights_default", "cpu", "noweights", {}, {}),
        ("cpu_linear_default", "cpu", "linear", {}, {}),
        ("cpu_linear_nopch", "cpu", "linear", NOPCH, {}),
        ("cpu_linear_march_v2", "cpu", "linear", {}, {"CXX": noarch}),
        ("cpu_linear_abi1", "cpu", "linear", {}, {"CXX": abi1}),
        ("cpu_linear_sysgomp_preload", "cpu", "linear", {}, {"LD_PRELOAD": sys_gomp} if sys_gomp else None),
        ("cpu_linear_all_fixes", "cpu", "linear", NOPCH, {"CXX": noarch}),
    ]
    alt = os.environ.get("ALT_CXX")  # another compiler binary to try, e.g. /usr/bin/g++ beside a wrapper
    if alt:
        variants.append(("cpu_linear_altcxx", "cpu", "linear", {}, {"CXX": alt}))
        if not cpu_only:
            variants.append(("cuda_linear_altcxx", "cuda", "linear", {}, {"CXX": alt}))
    if shutil.which("clang++"):  # different compiler entirely (needs libomp/omp.h usable by clang)
        variants.append(("cpu_linear_clang", "cpu", "linear", {}, {"CXX": shutil.which("clang++")}))
    if not cpu_only:
        variants += [
            ("cuda_noweights_default", "cuda", "noweights", {}, {}),
            ("cuda_linear_default", "cuda", "linear", {}, {}),
            ("cuda_linear_nopch", "cuda", "linear", NOPCH, {}),
            ("cuda_linear_march_v2", "cuda", "linear", {}, {"CXX": noarch}),
            ("cuda_linear_embed_kernels", "cuda", "linear", {"aot_inductor.embed_kernel_binary": True}, {}),
            ("cuda_linear_all_fixes", "cuda", "linear", dict(NOPCH, **{"aot_inductor.embed_kernel_binary": True}), {"CXX": noarch}),
        ]

    def run_child(name, args, extra_env, timeout=1800):
        e = dict(os.environ)
        tmp = os.path.join(out, name, "tmp")
        os.makedirs(tmp, exist_ok=True)
        e.update(TMPDIR=tmp, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "ind"),
                 TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", PYTHONFAULTHANDLER="1",
                 TORCH_SHOW_CPP_STACKTRACES="1")
        e.update({k: v for k, v in (extra_env or {}).items() if v})
        try:
            p = subprocess.run([PY, "-X", "faulthandler", HERE, *args], env=e, capture_output=True, text=True, timeout=timeout)
            rc, log = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as ex:
            rc, log = None, (ex.stdout or b"").decode(errors="replace") + (ex.stderr or b"").decode(errors="replace")
        with open(os.path.join(out, name + ".log"), "a") as f:
            f.write(f"$ {' '.join(args)}\n{log}\n")
        return rc, log, e

    # ---- JIT controls: same compiler/flags/libgomp, but no AOTI container/loader
    jits = [("jit_cpu", ["--jit", "cpu", "0"]), ("jit_cpu_cppwrapper", ["--jit", "cpu", "1"])]
    if not cpu_only:
        jits += [("jit_cuda", ["--jit", "cuda", "0"]), ("jit_cuda_cppwrapper", ["--jit", "cuda", "1"])]
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    if only:
        variants = [v for v in variants if v[0] in only]
        jits = [j for j in jits if j[0] in only]
    for name, args in jits:
        rc, log, _ = run_child(name, args, {})
        okl = [l for l in log.splitlines() if l.startswith("JIT OK")]
        summary.append(f"{name:32s} {sig(rc):10s} {(okl or log.strip().splitlines()[-1:] or [''])[0][:150]}")
    for name, device, model, cfg, extra_env in variants:
        if extra_env is None:
            summary.append(f"{name:32s} SKIPPED"); continue
        pt2 = os.path.join(out, name, "model.pt2")
        os.makedirs(os.path.dirname(pt2), exist_ok=True)
        rc, log, e = run_child(name + "_build", ["--build", model, device, pt2, json.dumps(cfg)], extra_env)
        if rc != 0:
            summary.append(f"{name:32s} BUILD {sig(rc)}: {log.strip().splitlines()[-1][:150] if log.strip() else ''}")
            continue
        # load always in a fresh process WITHOUT the CXX wrapper (load does not compile)
        load_env = {k: v for k, v in extra_env.items() if k != "CXX"}
        rc, log, e = run_child(name + "_load", ["--load", device, pt2, "ABCD"], load_env)
        stages = [l for l in log.splitlines() if l.startswith("STAGE")]
        summary.append(f"{name:32s} {sig(rc):10s} last={stages[-1] if stages else '-'}")
        if rc not in (0,) and env["gdb"] and not os.environ.get("NO_GDB"):
            bt = sh(f"cd {out} && " + " ".join(f"{k}='{v}'" for k, v in load_env.items() if v) +
                    f" TMPDIR={e['TMPDIR']} timeout 300 {env['gdb']} -q -batch -ex 'handle SIGSEGV stop' -ex run -ex bt -ex 'info registers rip' "
                    f"-ex 'x/3i $pc' --args {PY} {HERE} --load {device} {pt2} ABCD 2>&1 | grep -E '^#|=>|rip|signal|STAGE' | head -40")
            summary.append(textwrap.indent(bt, "    "))

    print("\nsummary in", os.path.join(out, "summary.txt"))
    print("\nlogs in", out)


if __name__ == "__main__":
    a = sys.argv
    if "--build" in a:
        i = a.index("--build"); build(a[i + 1], a[i + 2], a[i + 3], json.loads(a[i + 4]))
    elif "--load" in a:
        i = a.index("--load"); load(a[i + 1], a[i + 2], a[i + 3])
    elif "--jit" in a:
        i = a.index("--jit"); jit(a[i + 1], a[i + 2] == "1")
    else:
        main()
