"""The stored decision statement and the loader's choice on checkpoints of several shapes and dtypes.

    python3 benchmarks/gpu_decisions.py [--names a,b,...] [--parallel 4] [--build-args "..."]
    python3 benchmarks/gpu_decisions.py --names "" --bundles NAME=CKPT:BUNDLE,...   # bundles built elsewhere

For each `laya_aot.demo.MATRIX` checkpoint named it makes the checkpoint and builds a bundle for this GPU with
the default build (laya's precision policy; `--build-args` adds overrides), builds running in parallel. Then,
per bundle, a fresh process loads it with the defaults (`laya_aot.load(ckpt, bundle=..., device="cuda")`) and
reports which artifact serves and why (the load log line). Reports every artifact's stored verification:
status, the decision statement (agreement with fp32's decisions on the seeded decision suite, the artifact's
and laya eager's in the same dtype, the one-sided exact McNemar p-value) and the build's latency mix.
Writes gpu_decisions<tag>.json/.md and the build logs to --out.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harness

DEFAULT = ("hd32-absent-decisive", "hd16-16heads-fp16", "hd64-bf16-ctx1024", "hd32-8actions-ctx2048")
LOAD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
import laya_aot
agent = laya_aot.load({ckpt!r}, bundle={bundle!r}, device="cuda")
b = agent.backend_object
s = dict({{k: b.load_stats.get(k) for k in ("serving_dtype", "probe", "select_s")}}, artifact=b.artifact.name)
print("CHOICE", json.dumps(s, default=str))
"""


def build(name: str, work: Path, build_args: str) -> dict:
    from laya_aot.demo import make_checkpoint

    ckpt, bundle = work / ("ckpt-" + name), work / ("bundle-" + name)
    if not (ckpt / "model.safetensors").exists():
        make_checkpoint(ckpt, name, seed=0)
    if (bundle / "bundle.json").exists():
        return {"name": name, "ckpt": str(ckpt), "bundle": str(bundle), "build_rc": "kept from an earlier run"}
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "laya_aot.cli", "build", "checkpoint.path=%s" % ckpt,
                        "output_dir=%s" % bundle, "--quiet", *build_args.split()], capture_output=True, text=True)
    return {"name": name, "ckpt": str(ckpt), "bundle": str(bundle), "build_rc": p.returncode,
            "build_s": round(time.time() - t, 1), "log": (p.stdout + p.stderr)[-6000:]}


def choice(ckpt: str, bundle: str) -> dict:
    run = harness.python_child(LOAD.format(ckpt=ckpt, bundle=bundle), timeout=600)
    out: dict = {"rc": run.rc, **(run.result("CHOICE") or {})}
    out["log_line"] = next((x for x in run.stderr.splitlines() if " runs " in x and "laya-aot:" in x), None)
    if run.rc:
        out["stderr"] = run.stderr[-1500:]
    return out


def artifacts(bundle: str) -> list:
    m = json.loads((Path(bundle) / "bundle.json").read_text())
    rows = []
    for a in m["artifacts"]:
        v = a.get("verify") or {}
        rows.append({"name": a["name"], "kind": a["kind"], "dtype": a.get("dtype"), "status": a["status"],
                     "decisions": v.get("decisions"), "reason": v.get("reason"), "latency_ms": a.get("latency_ms")})
    return rows


def markdown(res: dict) -> str:
    lines = ["| checkpoint | artifact | dtype | status | decisions | artifact agrees with fp32 | laya eager in dtype | "
             "only artifact wrong / only eager wrong | p (one-sided McNemar) | holds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for b in res["bundles"]:
        for a in b.get("artifacts", []):
            d = a.get("decisions") or {}
            lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                b["name"], a["name"], a["dtype"], a["status"], d.get("decisions", "-"),
                _pct(d.get("artifact")), _pct(d.get("eager_in_dtype")),
                "%s / %s" % (d.get("artifact_only_wrong", "-"), d.get("eager_only_wrong", "-")),
                "%.3g" % d["p_value"] if "p_value" in d else "-",
                ("yes" if d["p_value"] >= d["alpha"] else "NO") if "p_value" in d else "-"))
    lines += ["", "| checkpoint | build s | serves | load log line |", "|---|---|---|---|"]
    for b in res["bundles"]:
        c = b.get("choice") or {}
        lines.append("| %s | %s | %s | %s |" % (b["name"], b.get("build_s", "-"), c.get("artifact"),
                                                 (c.get("log_line") or c.get("stderr") or "").replace("|", "/")))
    return "\n".join(lines) + "\n"


def _pct(x) -> str:
    return "-" if x is None else "%.2f%%" % (100 * x)


def main() -> None:
    ap = harness.parser(__doc__, work=True)
    ap.add_argument("--names", default=",".join(DEFAULT))
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--build-args", default="")
    ap.add_argument("--bundles", default="", help="report these NAME=CKPT:BUNDLE entries too (built elsewhere)")
    a = ap.parse_args()
    work, out = a.work, a.out
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in a.names.split(",") if n]
    from laya_aot.demo import make_checkpoint

    for n in names:  # serially: transformers' lazy imports are not safe from several threads at once
        if not (work / ("ckpt-" + n) / "model.safetensors").exists():
            make_checkpoint(work / ("ckpt-" + n), n, seed=0)
    with ThreadPoolExecutor(max(1, a.parallel)) as pool:
        built = list(pool.map(lambda n: build(n, work, a.build_args), names))
    for spec in filter(None, a.bundles.split(",")):
        name, paths = spec.split("=", 1)
        ckpt, bundle = paths.split(":", 1)
        built.append({"name": name, "ckpt": ckpt, "bundle": bundle})
    (out / "build_logs.txt").write_text("\n\n".join("## %s\n%s" % (b["name"], b.pop("log", "")) for b in built))
    res = {"environment": harness.environment(), "bundles": built}
    for b in built:  # results written after each load, so a run cut short keeps what it measured
        print(b["name"], "build", b.get("build_rc"), b.get("build_s"), flush=True)
        if (Path(b["bundle"]) / "bundle.json").exists():
            b["artifacts"] = artifacts(b["bundle"])
            b["choice"] = choice(b["ckpt"], b["bundle"])
            print(b["name"], b["choice"], flush=True)
        harness.write(out, "gpu_decisions" + a.tag, res, partial=True)
    harness.write(out, "gpu_decisions" + a.tag, res, markdown(res), title="Decision statements and the loader's choice")


if __name__ == "__main__":
    main()
