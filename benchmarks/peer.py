"""laya eager, laya-aot (each precision policy) and the peer runtime laya-cuda on one GPU, in one run (issue 56).

On the GPU host, with the slim site and the peer site unpacked (/work/shared/gpu/README.md):

    mkdir -p /tmp/site /tmp/psite && { [ -d /tmp/site/fastapi ] || tar -xJf .device-site/site.tar.xz -C /tmp/site; } \\
      && { [ -d /tmp/psite/laya_cuda ] || tar -xJf .device-site/peer-site.tar.xz -C /tmp/psite; } \\
      && PYTHONPATH=/tmp/site:/tmp/psite:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/peer.py --out $OUT

Resumable: checkpoints, bundles and every step's result live under --work (default artifacts/benchmarks/peer/work);
a step whose result is there is skipped, so the same command run again (on the same, still warm, machine) goes on where
the last one stopped when its --budget-s ran out. Each run writes peer.json and peer.md to --out from what is there,
finished or not (`"complete": false` lists what is missing).

Per checkpoint (`--shapes`, laya_aot.demo presets; default large-1024 and base-1024):
- bundles: `laya-aot build target=sm_90`, AOTInductor only (`--build-args`), once with the defaults
  (export.precision=faithful), once with export.precision=laya (laya's own dtype policy) and once with
  export.rows=packed (each row its own tokens, back to back);
- modes, each in a fresh process with private Inductor/Triton/laya-aot caches: `fp32` (laya eager with autocast off:
  the reference decisions only), `eager` (laya as it serves), `aot`, `aot-laya` and `aot-packed` (laya_aot.load of
  each bundle), `cuda` (laya_cuda.Engine, one predict per state), `cuda-batch` and `cuda-batch-wide`
  (laya_cuda.BatchEngine with its defaults and with 32 questions x 65,536 tokens, every state submitted at once; the
  calls with several states only).
  laya-cuda modes are skipped, with the reason, where `laya_cuda` does not import;
- calls, median of --repeats after --warmups, each call synchronised (answers are on the host when it returns):
  1 state x 1 choice question (20 words); 8 states x 3 questions (choice, noul, score; 120 words); 32 states x 3
  questions (400 words); one state and one choice question at 128, 512 and 1,024 tokens (the state sized with the
  checkpoint's tokenizer to the row length less the question's tokens); a stream of --stream requests of 40-1,000
  state tokens, 1-5 questions and 2-60 options, one request after the other, run once to warm up and then timed
  (p50, p95; a request a runtime refuses is counted, not timed);
- decisions: a seeded pool of choice questions (2-6 options) on states of 20-200 words; each mode's choices compared
  with the fp32 mode's, over the pool and over its near ties (fp32's top two probabilities within --near-gap),
  which must number at least --min-near (the pool grows with --pool-sets);
- starts: process start to first answer (a 1x1 call) of `aot` and `cuda`, first start (the mode's own run, its
  caches empty) and --starts later starts (the same caches, bytecode written by the first: every process writes its
  bytecode under --bytecode, also where the host's environment sets PYTHONDONTWRITEBYTECODE, as a pip install
  leaves bytecode beside each module).

`--device cpu` runs the torch modes on the CPU with a CPU bundle (`--build-args` there: no AOTInductor needed), for
checking this script where no GPU is (tests/bench_scripts/test_peer.py); laya-cuda needs CUDA and is skipped.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import gpu_bench  # beside this script: its fresh-cache environment, build step and bundle check
import harness

SHAPES = ("large-1024", "base-1024")
TORCH_MODES = ("fp32", "eager", "aot", "aot-laya", "aot-packed")
CUDA_MODES = ("cuda", "cuda-batch", "cuda-batch-wide")
BATCH_ONLY = ("cuda-batch", "cuda-batch-wide")  # BatchEngine: the calls with several states (and the first answer)
BUNDLES = {"aot": "", "aot-laya": "export.precision=laya", "aot-packed": "export.rows=packed"}
SINGLE_TOKENS = (128, 512, 1024)
QUESTION_OVERHEAD = 24  # tokens of a row that are not the state's, about, for the demo tokenizer's one choice question

CHOICE = {"team": {"type": "choice", "instructions": "Which team should handle this ticket?",
                   "criteria": {"billing": "payments, invoices, refunds", "technical": "errors, crashes, outages",
                                "account": "login, password, profile"}}}
THREE = dict(CHOICE, angry={"type": "noul", "instructions": "The customer is angry."},
             urgency={"type": "score", "instructions": "How urgent is this message?",
                      "criteria": ["not urgent", "somewhat urgent", "urgent", "critical, act now"]})


def _rng(seed: int):
    import numpy as np

    return np.random.default_rng(seed)


def words(rng, n: int) -> str:
    from laya_aot.demo import state_text

    return state_text(rng, n)


def sized_state(tok, rng, tokens: int) -> str:
    """Support-ticket words until the checkpoint's tokenizer counts `tokens` tokens (without special tokens)."""
    parts: List[str] = []
    while True:
        parts.append(words(rng, 8))
        text = " ".join(parts)
        if len(tok.encode(text, add_special_tokens=False).ids) >= tokens:
            return text


def calls(tok) -> Dict[str, Tuple[List[str], Dict[str, Any]]]:
    """The timed calls: name -> (states, questions)."""
    rng = _rng(56)
    out = {"1x1 choice, 20 words": ([words(rng, 20)], CHOICE),
           "8x3, 120 words": ([words(rng, 120) for _ in range(8)], THREE),
           "32x3, 400 words": ([words(rng, 400) for _ in range(32)], THREE)}
    for t in SINGLE_TOKENS:
        out["1x1 at %d tokens" % t] = ([sized_state(tok, rng, t - QUESTION_OVERHEAD)], CHOICE)
    return out


def stream(tok, n: int) -> List[Tuple[str, Dict[str, Any]]]:
    """`n` single requests: 40-1,000 state tokens, 1-5 questions, choices of 2-60 options, scores, noul."""
    rng = _rng(57)
    out = []
    for _ in range(n):
        qs: Dict[str, Any] = {}
        for j in range(int(rng.integers(1, 6))):
            kind = rng.choice(["choice", "choice", "choice", "score", "noul"])
            if kind == "choice":
                qs["q%d" % j] = {"type": "choice", "instructions": "Which fits? " + words(rng, 4),
                                 "criteria": {"o%d" % k: words(rng, 2) for k in range(int(rng.integers(2, 61)))}}
            elif kind == "score":
                qs["q%d" % j] = {"type": "score", "instructions": "Rate: " + words(rng, 4),
                                 "criteria": [words(rng, 2) for _ in range(int(rng.integers(2, 9)))]}
            else:
                qs["q%d" % j] = {"type": "noul", "instructions": "Is it true? " + words(rng, 5)}
        out.append((sized_state(tok, rng, int(rng.integers(40, 1001))), qs))
    return out


def decision_pool(sets: int, states: int = 24) -> List[Tuple[List[str], Dict[str, Any]]]:
    """`sets` calls of `states` states (20-200 words) and three choice questions of 2-6 options each."""
    rng = _rng(58)
    out = []
    for _ in range(sets):
        qs = {"c%d" % j: {"type": "choice", "instructions": "Which fits best? " + words(rng, 5),
                          "criteria": {"o%d" % k: words(rng, 2) for k in range(int(rng.integers(2, 7)))}}
              for j in range(3)}
        out.append(([words(rng, int(rng.integers(20, 201))) for _ in range(states)], qs))
    return out


class Runtime:
    """One mode's way of answering `ask(states, questions)` -> laya's answer dicts, one per state."""

    def __init__(self, mode: str, ckpt: str, bundle: str, device: str):
        self.mode = mode
        self.torch = mode in TORCH_MODES
        if mode in ("fp32", "eager"):
            import laya

            self.agent = laya.load(ckpt, device=device)
            if mode == "fp32":
                import torch

                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
                self.agent.amp_enabled = False  # laya's forward without autocast: its fp32 forward on this device
        elif mode in BUNDLES:
            import laya_aot

            self.agent = laya_aot.load(ckpt, bundle=bundle, device=device, strict=True)
        elif mode == "cuda":
            from laya_cuda import Engine

            self.engine = Engine(ckpt)
        else:
            from laya_cuda import BatchEngine

            wide = dict(max_batch_size=32, max_batch_tokens=65536) if mode == "cuda-batch-wide" else {}
            self.engine = BatchEngine(ckpt, **wide)

    def ask(self, states: List[str], questions: Dict[str, Any]) -> List[Dict[str, Any]]:
        if self.torch:
            return self.agent.predict_batch(states, questions)
        if self.mode == "cuda":
            return [self.engine.predict(s, questions) for s in states]
        return [f.result() for f in [self.engine.submit(s, questions) for s in states]]

    def facts(self) -> Dict[str, Any]:
        if not self.torch:
            return {}
        b = getattr(self.agent, "backend_object", None)
        art = getattr(b, "artifact", None)
        return {"backend": self.agent.backend, "artifact": getattr(art, "name", None),
                "precision": getattr(getattr(art, "precision", None), "reason", None)}


def _choices(answers: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per state: each choice question's chosen option and its two largest probabilities (laya rounds them)."""
    out = []
    for a in answers:
        row = {}
        for qid, ans in a["answers"].items():
            if ans.get("type") == "choice":
                p = sorted(ans["probabilities"].values(), reverse=True)
                row[qid] = [ans["choice"], p[0] - p[1] if len(p) > 1 else 1.0]
        out.append(row)
    return out


def requests(ckpt: Path, path: Path, stream_n: int, pool_sets: int) -> Dict[str, Any]:
    """Every request of the run for this checkpoint, made once (its tokenizer sizes the states) and kept in `path`:
    the children read them, so a laya-cuda child imports neither torch nor laya."""
    if path.exists():
        return json.loads(path.read_text())
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer" / "tokenizer.json"))
    tok.no_truncation()  # states are sized by counting tokens: a tokenizer file that truncates would never get there
    made = {"calls": calls(tok), "stream": stream(tok, stream_n), "pool": decision_pool(pool_sets)}
    path.write_text(json.dumps(made))
    return made


FIRST = "1x1 choice, 20 words"


def child(mode: str, ckpt: str, bundle: str, result: str, args: argparse.Namespace) -> None:
    """One mode in this fresh process: its first answer, then the calls, the stream and the decisions."""
    t0 = time.time()
    made = json.loads(Path(args.requests).read_text())
    if mode in TORCH_MODES:
        import torch
    t_torch = time.time()
    rt = Runtime(mode, ckpt, bundle, args.device)
    t_loaded = time.time()
    rt.ask(*made["calls"][FIRST])
    t_first = time.time()
    print("FIRST %.6f" % t_first, flush=True)
    res: Dict[str, Any] = {"mode": mode, "t_child_start": t0, "t_first": t_first, "facts": rt.facts(),
                           "calls_ms": {}, "versions": {},
                           "phases_s": {"import torch": t_torch - t0, "load (imports included)": t_loaded - t_torch,
                                        "first call": t_first - t_loaded}}
    if mode not in TORCH_MODES:
        del res["phases_s"]["import torch"]
    if mode in BUNDLES:  # the load's own timeline (laya's agent, the artifact's probe, load and checks)
        res["load_stats"] = json.loads(json.dumps(getattr(rt.agent.backend_object, "load_stats", {}), default=str))
    if mode in TORCH_MODES:
        res["import_torch_s"] = t_torch - t0
        res["versions"]["torch"] = torch.__version__
        if args.device == "cuda":
            res["versions"]["gpu"] = torch.cuda.get_device_name()
    if args.start_only:
        Path(result).write_text(json.dumps(res))
        return
    if mode != "fp32":
        for name, (states, qs) in made["calls"].items():
            if mode in BATCH_ONLY and len(states) == 1 and name != FIRST:
                continue
            for _ in range(args.warmups):
                rt.ask(states, qs)
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                rt.ask(states, qs)
                times.append((time.perf_counter() - t) * 1e3)
            res["calls_ms"][name] = statistics.median(times)
            print("[%s] %s %.2f ms" % (mode, name, res["calls_ms"][name]), flush=True)
        if mode not in BATCH_ONLY:
            res["stream"] = _stream(rt, made["stream"])
    res["decisions"] = [_choices(rt.ask(states, qs)) for states, qs in made["pool"]]
    Path(result).write_text(json.dumps(res))


def _stream(rt: Runtime, requests: List[Tuple[str, Dict[str, Any]]]) -> Dict[str, Any]:
    """The requests once to warm up, then timed one by one: p50, p95 (ms) and the ones refused."""
    refused: Dict[int, str] = {}
    for i, (s, qs) in enumerate(requests):
        try:
            rt.ask([s], qs)
        except Exception as e:  # noqa: BLE001 - a runtime's refusal is a figure of the run
            refused[i] = "%s: %s" % (type(e).__name__, str(e)[:120])
    times = []
    for i, (s, qs) in enumerate(requests):
        if i in refused:
            continue
        t = time.perf_counter()
        rt.ask([s], qs)
        times.append((time.perf_counter() - t) * 1e3)
    q = statistics.quantiles(times, n=20) if len(times) >= 2 else [float("nan")] * 19
    return {"requests": len(requests), "timed": len(times), "p50_ms": statistics.median(times) if times else None,
            "p95_ms": q[18], "refused": refused}


def spawn(mode: str, ckpt: Path, bundle: Path, work: Path, result: Path, args: argparse.Namespace, timeout: float,
          start_only: bool = False) -> Dict[str, Any]:
    """`mode` in a fresh process with its own caches (the same ones for its later starts), on the requests in
    `work`/requests.json; its result, with the parent's wall clock from spawn to the child's first answer."""
    env = gpu_bench._env(work, mode, "%s-%s" % (ckpt.name, mode), no_nvcc=mode in BUNDLES)
    cmd = [sys.executable, __file__, "--child", mode, "--ckpt", str(ckpt), "--bundle", str(bundle),
           "--result", str(result), "--device", args.device, "--repeats", str(args.repeats), "--warmups",
           str(args.warmups), "--requests", str(work / "requests.json")]
    cmd += ["--start-only"] if start_only else []
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        log, rc = p.stdout[-20000:] + "\n" + p.stderr[-20000:], p.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = str(e.stdout or "")[-5000:] + str(e.stderr or "")[-5000:], None
    (work / ("log_%s_%s%s.txt" % (ckpt.name, mode, "_start" if start_only else ""))).write_text(log)
    if rc != 0 or not result.exists():
        return {"mode": mode, "error": "exit %s: %s" % (rc, (log.strip().splitlines() or [""])[-1][:300])}
    r = json.loads(result.read_text())
    r["start_to_first_s"] = r["t_first"] - t0
    result.write_text(json.dumps(r))
    return r


def peer_missing() -> Optional[str]:
    """Why laya-cuda cannot run here (None: it can be imported)."""
    if importlib.util.find_spec("laya_cuda") is None:
        return ("laya_cuda is not importable: unpack the peer site (/work/shared/gpu/make-peer-site.sh) and put it "
                "on PYTHONPATH")
    return None


def build_all(shapes: List[str], work: Path, args: argparse.Namespace, t_end: float) -> Dict[str, Any]:
    """Every bundle not yet built from its checkpoint, `--parallel-builds` at a time."""
    todo = []
    for shape in shapes:
        ckpt = work / shape / "ckpt"
        for mode, extra in BUNDLES.items():
            if mode not in args.modes:
                continue
            bundle = work / shape / ("bundle-" + mode)
            if not gpu_bench._built_from(bundle, ckpt):
                todo.append((shape, mode, ckpt, bundle, "%s %s" % (args.build_args, extra)))

    def one(item):
        shape, mode, ckpt, bundle, extra = item
        bwork = work / shape / ("build-" + mode)
        bwork.mkdir(parents=True, exist_ok=True)
        target = [] if args.device == "cuda" else ["target=cpu"]
        return "%s/%s" % (shape, mode), _build(ckpt, bundle, bwork, extra, target, max(60.0, t_end - time.time()))

    with ThreadPoolExecutor(max(1, args.parallel_builds)) as pool:
        return dict(pool.map(one, todo))


def _build(ckpt: Path, bundle: Path, work: Path, extra: str, target: List[str], timeout: float) -> Dict[str, Any]:
    if not target:  # gpu_bench's own: target sm_90 in a child with private caches
        return gpu_bench.build(ckpt, bundle, work, extra, timeout)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "laya_aot.cli", "build", "checkpoint.path=%s" % ckpt,
                        "output_dir=%s" % bundle, "--quiet", *target, *extra.split()], capture_output=True, text=True,
                       timeout=timeout)
    (work / "build_log.txt").write_text(p.stdout[-20000:] + p.stderr[-20000:])
    return {"rc": p.returncode, "seconds": round(time.time() - t0, 1)}


def decisions(modes: Dict[str, Dict[str, Any]], near_gap: float) -> Dict[str, Any]:
    """Each mode's choices against the fp32 mode's: over the whole pool and over its near ties."""
    ref = modes.get("fp32", {}).get("decisions")
    if not ref:
        return {"error": "no fp32 reference yet"}
    keys = [(i, j, q) for i, call in enumerate(ref) for j, row in enumerate(call) for q in row]
    near = [k for k in keys if ref[k[0]][k[1]][k[2]][1] <= near_gap]
    out: Dict[str, Any] = {"pool": len(keys), "near_ties": len(near), "near_gap": near_gap}
    for mode, r in modes.items():
        got = r.get("decisions")
        if mode == "fp32" or not got:
            continue
        same = {k: got[k[0]][k[1]].get(k[2], [None])[0] == ref[k[0]][k[1]][k[2]][0] for k in keys}
        out[mode] = {"overall": [sum(same.values()), len(keys)], "near": [sum(same[k] for k in near), len(near)]}
    return out


def markdown(res: Dict[str, Any]) -> str:
    lines = ["Device: %s; complete: %s" % (res.get("gpu", res["device"]), res["complete"]), ""]
    cols = [m for m in ("eager", "aot", "aot-laya", "aot-packed") + CUDA_MODES]
    for shape, s in res["shapes"].items():
        modes = s.get("modes", {})
        lines += ["## `%s`" % shape, "", "Median ms (stream: p50 / p95 ms); ratio: laya-aot (default) / laya-cuda's "
                  "fastest mode on that call.", "",
                  "| call | " + " | ".join(cols) + " | aot / best laya-cuda | aot-packed / best laya-cuda |",
                  "|---|" + "---|" * (len(cols) + 2)]
        names = list(next((m["calls_ms"] for m in modes.values() if m.get("calls_ms")), {}))
        for name in names + ["stream p50", "stream p95"]:
            cells, vals = [], {}
            for m in cols:
                r = modes.get(m, {})
                v = (r.get("stream") or {}).get(name.split()[1] + "_ms") if name.startswith("stream") \
                    else (r.get("calls_ms") or {}).get(name)
                vals[m] = v
                cells.append("%.2f" % v if isinstance(v, (int, float)) else (r.get("skipped") and "skipped" or "-"))
            peers = [vals[m] for m in CUDA_MODES if isinstance(vals.get(m), (int, float))]
            ratios = ["%.2fx" % (vals[m] / min(peers)) if peers and isinstance(vals.get(m), (int, float)) else "-"
                      for m in ("aot", "aot-packed")]
            lines.append("| %s | %s | %s |" % (name, " | ".join(cells), " | ".join(ratios)))
        d = s.get("decisions", {})
        lines += ["", "Decisions equal to laya's fp32 forward (%s pool decisions; near ties: fp32's top two within "
                  "%s, %s of them):" % (d.get("pool"), d.get("near_gap"), d.get("near_ties")), "",
                  "| mode | overall | near ties |", "|---|---|---|"]
        for m in ("eager", "aot", "aot-laya", "aot-packed", "cuda"):
            if m in d:
                o, n = d[m]["overall"], d[m]["near"]
                lines.append("| %s | %d / %d (%.1f%%) | %d / %d (%.1f%%) |" % (
                    m, o[0], o[1], 100 * o[0] / max(1, o[1]), n[0], n[1], 100 * n[0] / max(1, n[1])))
        if d.get("short") or d.get("error"):
            lines.append("\n%s" % (d.get("short") or d.get("error")))
        lines += ["", "Process start to first answer (s): first start (empty caches) and later starts (median):", "",
                  "| mode | first | later starts | import torch |", "|---|---|---|---|"]
        for m in ("aot", "cuda"):
            first = modes.get(m, {}).get("start_to_first_s")
            later = [x["start_to_first_s"] for x in s.get("starts", {}).get(m, []) if "start_to_first_s" in x]
            torch_s = [x["import_torch_s"] for x in s.get("starts", {}).get(m, []) if "import_torch_s" in x]
            lines.append("| %s | %s | %s | %s |" % (m, "%.2f" % first if first else "-",
                                                    "%.2f (%d)" % (statistics.median(later), len(later)) if later
                                                    else "-", "%.2f" % statistics.median(torch_s) if torch_s else "-"))
        lines += _phases(s.get("starts", {}))
        for m, r in modes.items():
            if r.get("error") or r.get("skipped"):
                lines.append("- %s: %s" % (m, r.get("error") or r.get("skipped")))
        lines.append("")
    return "\n".join(lines) + "\n"


def _phases(starts: Dict[str, List[Dict[str, Any]]]) -> List[str]:
    """The later starts' breakdown (median seconds of each phase in the child; the rest of a start is the
    interpreter's own start before the child's first line)."""
    lines = ["", "Later starts by phase (median s; the child's clock):", "", "| mode | phase | s |", "|---|---|---|"]
    for m in ("aot", "cuda"):
        got = [x["phases_s"] for x in starts.get(m, []) if "phases_s" in x]
        for phase in (got[0] if got else {}):
            lines.append("| %s | %s | %.3f |" % (m, phase, statistics.median(g[phase] for g in got)))
        stats = [x["load_stats"] for x in starts.get(m, []) if x.get("load_stats")]
        for key, v in sorted((stats[0] if stats else {}).items()):
            if key.endswith("_s") and isinstance(v, (int, float)):
                vals = [st[key] for st in stats if isinstance(st.get(key), (int, float))]
                lines.append("| %s | load: %s | %.3f |" % (m, key, statistics.median(vals)))
    return lines


def stream_cells(ckpt: Path, stream_reqs: List[Any]) -> Dict[str, Any]:
    """The stream's tokens as laya-aot computes them, on the host (no GPU, no forward): real tokens, the cells of
    each call padded to its longest row (a multiple of 16), as served (stepped where the call is small enough for
    a CUDA graph, `padding.for_runner`), and packed (each row only its own tokens rounded up to 16, as laya-cuda
    and packed rows compute them)."""
    import laya
    import laya.agent

    from laya_aot.kinds.exported_program_settings import ExportConfig
    from laya_aot.kinds.graphs import GraphedCalls
    from laya_aot.padding import TOKEN_MULTIPLE, Ranges, context_tokens

    class Collated(Exception):
        pass

    agent = laya.load(str(ckpt), device="cpu")
    e = ExportConfig()  # the ranges the build's export asks for by default
    ranges = Ranges(1, e.max_rows, 2 * TOKEN_MULTIPLE, context_tokens(agent.cfg.get("max_len", 512)), 2, e.max_markers)
    graphs = GraphedCalls(lambda *xs: xs)  # its `shape_for` decides which calls are stepped; nothing is called
    stock, seen = laya.agent.collate_items, []

    def spy(batch: Any, pad_id: int) -> Any:
        b = stock(batch, pad_id)
        seen.append((b["attention_mask"].sum(1).tolist(), b["marker_pos"].shape[1]))
        raise Collated

    laya.agent.collate_items = spy
    cells = {"real": 0, "padded": 0, "served": 0, "packed": 0}
    try:
        for state, questions in stream_reqs:
            try:
                agent.predict_batch([state], questions)
            except Collated:
                pass
            lens, markers = seen[-1]
            n, padded = len(lens), ranges.padded_tokens(max(lens))
            shape = graphs.shape_for(n, padded, markers, ranges)
            cells["real"] += sum(lens)
            cells["padded"] += n * padded
            cells["served"] += n * padded if shape is None else shape[0] * shape[1]
            cells["packed"] += sum(-(-length // 16) * 16 for length in lens)
    finally:
        laya.agent.collate_items = stock
    return dict(cells, **{k + "_per_real": round(cells[k] / cells["real"], 3) for k in ("padded", "served", "packed")})


def main() -> None:
    ap = harness.parser(__doc__, work=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--modes", default=",".join(TORCH_MODES + CUDA_MODES),
                    help="the modes to run (fp32 always gives the reference decisions)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--build-args", default="stages.onnx=false stages.tilelang=false stages.inductor_cache=false")
    ap.add_argument("--parallel-builds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmups", type=int, default=3)
    ap.add_argument("--stream", type=int, default=200)
    ap.add_argument("--pool-sets", type=int, default=96, help="decision pool: calls of 24 states x 3 choices")
    ap.add_argument("--near-gap", type=float, default=0.05)
    ap.add_argument("--min-near", type=int, default=2000)
    ap.add_argument("--starts", type=int, default=3, help="later starts of aot and cuda")
    ap.add_argument("--bytecode", default="", help="PYTHONPYCACHEPREFIX of every process (default: --work/pyc)")
    ap.add_argument("--timeout", type=float, default=300, help="per mode, seconds")
    ap.add_argument("--budget-s", type=float, default=540, help="start no step once this is spent")
    ap.add_argument("--child")
    ap.add_argument("--ckpt")
    ap.add_argument("--bundle")
    ap.add_argument("--result")
    ap.add_argument("--requests")
    ap.add_argument("--start-only", action="store_true")
    ap.add_argument("--cells", action="store_true",
                    help="only the stream's computed cells per real token, on the host (`stream_cells`)")
    a = ap.parse_args()
    a.modes = {"fp32", *a.modes.split(",")}
    if a.cells:
        cells(a)
        return
    if a.child:
        child(a.child, a.ckpt, a.bundle, a.result, a)
        return
    run(a)


def cells(a: argparse.Namespace) -> None:
    """`--cells`: each shape's checkpoint and stream made as `run` makes them, then `stream_cells`."""
    res: Dict[str, Any] = {"environment": harness.environment(), "stream": a.stream, "shapes": {}}
    for shape in [s for s in a.shapes.split(",") if s]:
        ckpt = Path(a.work) / shape / "ckpt"
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        subprocess.check_call([sys.executable, "-m", "laya_aot.cli", "make-demo", str(ckpt), "--shape", shape])
        made = requests(ckpt, ckpt.parent / "requests.json", a.stream, a.pool_sets)
        res["shapes"][shape] = stream_cells(ckpt, made["stream"])
        print(shape, json.dumps(res["shapes"][shape]), flush=True)
    lines = ["| checkpoint | real tokens | padded / real | as served / real | packed / real |", "|---|---|---|---|---|"]
    lines += ["| %s | %d | %.3f | %.3f | %.3f |" % (k, v["real"], v["padded_per_real"], v["served_per_real"],
                                                   v["packed_per_real"]) for k, v in res["shapes"].items()]
    harness.write(Path(a.out), "stream_cells" + a.tag, res, "\n".join(lines) + "\n", title="The stream's cells")


def run(a: argparse.Namespace) -> Dict[str, Any]:
    t_end = time.time() + a.budget_s
    work, out = Path(a.work), Path(a.out)
    # a host image may set PYTHONDONTWRITEBYTECODE: then no later start would find bytecode, unlike a pip install's
    os.environ["PYTHONPYCACHEPREFIX"] = str(Path(a.bytecode or work / "pyc").resolve())
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    out.mkdir(parents=True, exist_ok=True)
    shapes = [s for s in a.shapes.split(",") if s]
    res: Dict[str, Any] = {"device": a.device, "shapes": {}, "complete": False}
    for shape in shapes:
        ckpt = work / shape / "ckpt"
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        subprocess.check_call([sys.executable, "-m", "laya_aot.cli", "make-demo", str(ckpt), "--shape", shape])
        requests(ckpt, ckpt.parent / "requests.json", a.stream, a.pool_sets)
    builds = build_all(shapes, work, a, t_end)
    why_peer = peer_missing() if a.device == "cuda" else "laya-cuda runs on CUDA only"
    missing = []
    for shape in shapes:
        s = res["shapes"].setdefault(shape, {"builds": {k: v for k, v in builds.items() if k.startswith(shape)},
                                             "modes": {}, "starts": {}})
        ckpt = work / shape / "ckpt"
        for mode in [m for m in TORCH_MODES + CUDA_MODES if m in a.modes]:
            result = work / shape / ("%s.json" % mode)
            if mode in CUDA_MODES and why_peer:
                s["modes"][mode] = {"skipped": why_peer}
                continue
            if not result.exists() and t_end - time.time() > 30:
                bundle = work / shape / ("bundle-" + mode) if mode in BUNDLES else Path("-")
                r = spawn(mode, ckpt, bundle, work / shape, result, a, min(a.timeout, t_end - time.time()))
                print(shape, mode, json.dumps({k: r.get(k) for k in ("error", "start_to_first_s", "calls_ms")}),
                      flush=True)
            if result.exists():
                s["modes"][mode] = json.loads(result.read_text())
            else:
                missing.append("%s/%s" % (shape, mode))
                s["modes"].setdefault(mode, {"error": "not run yet (budget spent or it failed: see its log)"})
        for mode in [m for m in ("aot", "cuda") if m in a.modes]:
            if mode == "cuda" and why_peer:
                continue
            got = []
            for i in range(a.starts):
                result = work / shape / ("start-%s-%d.json" % (mode, i))
                if not result.exists() and t_end - time.time() > 30 and (work / shape / ("%s.json" % mode)).exists():
                    bundle = work / shape / ("bundle-" + mode) if mode in BUNDLES else Path("-")
                    spawn(mode, ckpt, bundle, work / shape, result, a, min(a.timeout, t_end - time.time()),
                          start_only=True)
                if result.exists():
                    got.append(json.loads(result.read_text()))
                else:
                    missing.append("%s/start-%s-%d" % (shape, mode, i))
            s["starts"][mode] = got
        s["decisions"] = decisions(s["modes"], a.near_gap)
        if isinstance(s["decisions"].get("near_ties"), int) and s["decisions"]["near_ties"] < a.min_near:
            s["decisions"]["short"] = ("%d near ties, fewer than --min-near %d: run again with a larger --pool-sets "
                                       "(delete %s/*.json first: the requests and every mode's result)"
                                       % (s["decisions"]["near_ties"], a.min_near, work / shape))
        for r in s["modes"].values():
            r.pop("decisions", None)  # the pool's raw choices stay in --work
            if r.get("versions", {}).get("gpu"):
                res["gpu"] = r["versions"]["gpu"]
    res["complete"] = not missing
    res["missing"] = missing
    harness.write(out, "peer" + a.tag, res, markdown(res), title="laya eager, laya-aot and laya-cuda on one GPU")
    return res


if __name__ == "__main__":
    main()
