"""What every benchmark shares: its arguments, its timing, the environment a figure was measured in (the command,
the hardware, the versions) and its result files; and the realistic typed calls the call and start benchmarks ask.

A benchmark script (run as `python benchmarks/NAME.py`, which puts this folder on `sys.path`):

    import harness

    ap = harness.parser(__doc__)                 # --out (default artifacts/benchmarks/NAME/) and --tag
    ...
    harness.write(a.out, "NAME" + a.tag, result, markdown(result), title="...")

`write` stores the result beside `environment()` in NAME.json and a page NAME.md headed by the command, the
hardware and the versions, so that a figure never travels without them. Children of a benchmark (one process per
start or per path) print one `RESULT <json>` line (`emit`), which `spawn(...).result()` reads back.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "artifacts" / "benchmarks"  # where a run's files go unless --out says otherwise (ignored by git)
PACKAGES = ("torch", "laya", "laya-aot", "transformers", "tokenizers", "triton", "tilelang", "onnxruntime",
            "numpy", "fastapi", "uvicorn")


# ------------------------------------------------------------------------------------------------ arguments
def script() -> str:
    """The running benchmark's name (its file's stem)."""
    return Path(sys.argv[0]).stem or "benchmark"


def parser(doc: Optional[str], work: bool = False) -> argparse.ArgumentParser:
    """An argument parser with the module docstring as its help and the options every benchmark has: `--out`
    (where the result files go; default `artifacts/benchmarks/<script>/`) and `--tag` (a suffix naming one run);
    with `work`, also `--work` (scratch space for checkpoints, bundles, caches and logs; default `work/` under the
    default output folder)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / script(),
                    help="folder for the result files (default: artifacts/benchmarks/%(prog)s's stem)")
    ap.add_argument("--tag", default="", help="suffix of the result files' names (several runs in one folder)")
    if work:
        ap.add_argument("--work", type=Path, default=RESULTS / script() / "work",
                        help="scratch folder: checkpoints, bundles, caches, logs")
    return ap


def command() -> str:
    """This run's command line as a person would type it from the repository root."""
    path = Path(sys.argv[0]).resolve()
    shown = os.path.relpath(path, ROOT) if ROOT in path.parents else str(path)
    return " ".join(shlex.quote(x) for x in ["python", shown, *sys.argv[1:]])


# ------------------------------------------------------------------------------------------------ environment
def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpus() -> List[str]:
    """Each GPU as 'name, memory, driver', from nvidia-smi (so the harness never makes a CUDA context itself);
    from torch when nvidia-smi is absent and torch is already imported."""
    if shutil.which("nvidia-smi"):
        p = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        if p.returncode == 0:
            return [line.strip() for line in p.stdout.splitlines() if line.strip()]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return []


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    return None


def _commit() -> Optional[str]:
    p = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
                       capture_output=True, text=True)
    return (p.stdout.strip() or None) if p.returncode == 0 else None


def environment() -> Dict[str, Any]:
    """What a figure was measured with: the command, the commit, the hardware, the versions, the machine's load."""
    return {"command": command(), "commit": _commit(), "platform": platform.platform(),
            "python": platform.python_version(), "cpu": _cpu(), "cores": os.cpu_count(), "memory_gb": _memory_gb(),
            "gpus": _gpus(), "versions": {p: v for p in PACKAGES if (v := _version(p))},
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "env": {k: v for k, v in os.environ.items()
                    if k.startswith(("LAYA_AOT_", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX"))}}


def environment_lines(env: Dict[str, Any]) -> List[str]:
    """The environment as the lines that head a result page."""
    gpus = "; ".join(env.get("gpus") or []) or "none"
    versions = ", ".join("%s %s" % kv for kv in (env.get("versions") or {}).items())
    return ["Command: `%s`" % env["command"], "",
            "Hardware: GPU %s; CPU %s, %s cores, %s GB; %s" % (gpus, env.get("cpu"), env.get("cores"),
                                                                env.get("memory_gb"), env.get("platform")),
            "",
            "Versions: python %s, %s; commit %s; load average %s" % (env.get("python"), versions, env.get("commit"),
                                                                    " ".join(map(str, env.get("loadavg") or []))),
            ""]


# ------------------------------------------------------------------------------------------------ results
def write(out: Path, name: str, result: Dict[str, Any], body: str = "", title: Optional[str] = None,
          partial: bool = False) -> Path:
    """NAME.json (the result and its environment) and, unless `partial`, NAME.md (a title, the environment's lines,
    `body`) in `out`; prints the page. A `partial` write (a run that may be cut short keeps what it measured) writes
    NAME.partial.json only. Returns the JSON's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = result.get("environment") or environment()
    doc = dict(result, environment=env)
    path = out / ("%s%s.json" % (name, ".partial" if partial else ""))
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    if not partial:
        page = "\n".join(["# %s" % (title or name), "", *environment_lines(env), body.rstrip(), ""])
        (out / ("%s.md" % name)).write_text(page)
        print(page, flush=True)
    return path


def emit(result: Dict[str, Any], mark: str = "RESULT") -> None:
    """A child's result, as the one line its parent reads (`ChildRun.result`)."""
    print("%s %s" % (mark, json.dumps(result, default=str)), flush=True)


@dataclass
class ChildRun:
    """A finished (or timed-out: `rc` None) child process and what it printed."""

    rc: Optional[int]
    stdout: str
    stderr: str
    started: float  # time.time() just before the spawn
    seconds: float = 0.0  # how long it ran

    def result(self, mark: str = "RESULT") -> Optional[Dict[str, Any]]:
        """The JSON of the child's first `MARK <json>` line."""
        for line in self.stdout.splitlines():
            if line.startswith(mark + " "):
                return json.loads(line[len(mark) + 1:])
        return None

    def since_spawn(self, mark: str = "FIRST") -> Optional[float]:
        """Seconds from the spawn to the wall clock the child printed as `MARK <time.time()>` (its first answer)."""
        for line in self.stdout.splitlines():
            if line.startswith(mark + " "):
                return round(float(line.split()[1]) - self.started, 3)
        return None

    def failure(self, tail: int = 3000) -> Dict[str, Any]:
        """Why it gave no result: its exit status (None: timed out) and the end of its stderr."""
        return {"rc": self.rc, "stderr": self.stderr[-tail:]}

    def result_or_failure(self, mark: str = "RESULT") -> Dict[str, Any]:
        found = self.result(mark)
        return found if found is not None else self.failure()


def spawn(cmd: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: Optional[float] = None,
          cwd: Optional[Path] = None) -> ChildRun:
    """Run a child to its end (or `timeout`), capturing its output."""
    t0 = time.time()
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
        return ChildRun(p.returncode, p.stdout, p.stderr, t0, time.time() - t0)
    except subprocess.TimeoutExpired as e:
        def text(x) -> str:
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
        return ChildRun(None, text(e.stdout), text(e.stderr) + "\n(timed out after %.0f s)" % timeout, t0,
                        time.time() - t0)


def python_child(code: str, env: Optional[Dict[str, str]] = None, timeout: Optional[float] = None) -> ChildRun:
    """A fresh `python -c CODE`: a start exactly as a user's process runs it."""
    return spawn([sys.executable, "-c", code], env=env, timeout=timeout)


def without_nvcc(env: Dict[str, str]) -> Dict[str, str]:
    """`env` with every PATH entry holding nvcc left out: a process that cannot compile a CUDA kernel."""
    return dict(env, PATH=os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                          if p and not shutil.which("nvcc", path=p)))


def private_caches(env: Dict[str, str], folder: Path) -> Dict[str, str]:
    """`env` with empty Inductor, Triton, TileLang and laya-aot caches of its own under `folder`: a process that
    starts as on a new machine."""
    return dict(env, TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"), TRITON_CACHE_DIR=str(folder / "triton"),
                TILELANG_CACHE_DIR=str(folder / "tilelang"), LAYA_AOT_CACHE_DIR=str(folder / "laya-aot"))


# ------------------------------------------------------------------------------------------------ timing
def synchronizer(device: str) -> Callable[[], None]:
    """What waits for the device's queued work: torch.cuda.synchronize on a GPU, nothing on the CPU."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return lambda: None


def times_ms(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3, device: str = "cpu") -> List[float]:
    """Wall ms of each of `repeats` calls of `fn` after `warmup` untimed ones, synchronised before and after."""
    sync = synchronizer(device)
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def median_ms(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3, device: str = "cpu") -> float:
    """The median of `times_ms`, rounded to the microsecond."""
    return round(statistics.median(times_ms(fn, repeats, warmup, device)), 3)


def cuda_event_ms(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3) -> float:
    """The median GPU time between CUDA events around each call (no host synchronisation inside the timing)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def predict_ms(agent: Any, batch_states: List[str], questions: Dict[str, Any], repeats: int = 15, warmup: int = 3,
               device: str = "cpu") -> tuple:
    """(median ms, the last answers) of `agent.predict_batch(batch_states, questions)`, timed as a service times a
    call: one synchronisation after it, nothing inside it."""
    last: Dict[str, Any] = {}

    def call() -> None:
        last["answers"] = agent.predict_batch(batch_states, questions)

    return median_ms(call, repeats, warmup, device), last["answers"]


def spread(xs: Sequence[float], with_median: bool = False) -> List[float]:
    """[p10, p90] (the median between them when asked) of timed rounds, rounded."""
    q = statistics.quantiles(xs, n=10)
    picked = [q[0], statistics.median(xs), q[-1]] if with_median else [q[0], q[-1]]
    return [round(x, 3) for x in picked]


def shapes_arg(text: str) -> List[tuple]:
    """'1x128,8x256' -> [(1, 128), (8, 256)]."""
    return [tuple(int(n) for n in s.split("x")) for s in text.split(",") if s]


# ------------------------------------------------------------------------------------------------ workloads
ONE = {"team": {"type": "choice", "instructions": "Which team should handle this?",
                "criteria": {"billing": "payments, refunds", "technical": "errors, outages", "account": "login"}}}
THREE = dict(ONE, urgent={"type": "noul", "instructions": "Is this urgent?"},
             severity={"type": "score", "instructions": "How severe is it?",
                       "criteria": ["minor", "moderate", "serious", "critical"]})
STATE = "I was charged twice for the March invoice"
# the realistic typed calls: (name, states, words per state, questions)
CALLS = (("1x1q_20w", 1, 20, ONE), ("8x3q_120w", 8, 120, THREE), ("32x3q_400w", 32, 400, THREE))
FORWARD_SHAPES = ((1, 128), (8, 256), (32, 512), (32, 1024))  # rows x tokens of the forward-only timings


def states(n: int, words: int, seed: Optional[int] = None) -> List[str]:
    """`n` synthetic support messages of `words` words (the demo's vocabulary), seeded."""
    import numpy as np

    from laya_aot.demo import state_text

    rng = np.random.default_rng(n * 1000 + words if seed is None else seed)
    return [state_text(rng, words) for _ in range(n)]


def decision(answer: Dict[str, Any]) -> Any:
    """What a caller acts on: the noul verdict, the chosen option, or the most probable score level."""
    if "noul" in answer:
        return answer["noul"] > 0.5
    if answer.get("type") == "choice" and "choice" in answer:
        return answer["choice"]
    probs = answer.get("probabilities") or {}
    return max(probs, key=probs.get) if probs else answer.get("choice")


def margin(answer: Dict[str, Any]) -> float:
    """How far an answer is from flipping: the top-two probability gap, or the noul verdict's distance from 0.5."""
    if "noul" in answer:
        return abs(answer["noul"] - 0.5)
    top = sorted((answer.get("probabilities") or {}).values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else 1.0


def forward_args(rows: int, length: int, vocab: int = 4000, device: str = "cpu", seed: int = 0) -> tuple:
    """A model forward's inputs at rows x length: seeded token ids within the vocabulary, 4 option markers, the
    first question type."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, min(4000, vocab), (rows, length), generator=g)
    args = (ids, torch.ones_like(ids), torch.tensor([[1, 2, 3, 4]] * rows), torch.ones((rows, 4), dtype=torch.bool),
            torch.zeros((rows,), dtype=torch.long))
    return tuple(t.to(device) for t in args)


def vocab_of(tensors: Dict[str, Any]) -> int:
    """The encoder's vocabulary size from a checkpoint's tensors (its token embedding's rows)."""
    return min(int(t.shape[0]) for k, t in tensors.items() if k.endswith("tok_embeddings.weight"))
