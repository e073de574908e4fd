"""`python -m laya_aot.serve_ray`: `laya-aot serve` as a Ray Serve deployment, for more than one GPU or machine.

Each replica is the whole app `laya-aot serve` runs (laya's routes and answers, the bundles, `GET /v1/aot`, the
dynamic batcher inside it), built on the replica from the same environment (`serve.create_app`); Ray Serve's
proxy spreads requests over the replicas. One replica per GPU Ray sees (each given one GPU), one on a machine
without; settings (environment, beside laya's and laya-aot serve's):

  LAYA_AOT_RAY_REPLICAS      replicas (default: one per GPU in the cluster, else 1)
  LAYA_AOT_RAY_PER_GPU       replicas sharing one GPU (default 1; each asks Ray for 1/N of a GPU): more processes
                             on a GPU where one process's host work (Python, one interpreter lock) is the limit
  LAYA_AOT_RAY_AUTOSCALING   JSON: Ray Serve's autoscaling_config instead of a fixed count, e.g.
                             '{"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 32}'
  LAYA_AOT_RAY_ADDRESS       a running Ray cluster to join (default: a local one, started here)
  LAYA_AOT_RAY_MAX_ONGOING   requests one replica takes at once (default LAYA_MAX_CONCURRENT, laya's 16 when
                             unset): its batcher merges those; the rest wait in Ray's queue

A replica runs LAYA_THREADS compute threads (default 1) and asks Ray for that many CPUs. The proxy listens on
LAYA_HOST:LAYA_PORT (laya's defaults: 0.0.0.0:8000). SIGTERM or Ctrl-C stops the deployment and the local
cluster. Ray Serve is the `ray` extra: pip install "laya-aot[ray,serve]".
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Mapping, Optional

log = logging.getLogger("laya_aot.serve")

ENV_REPLICAS = "LAYA_AOT_RAY_REPLICAS"
ENV_AUTOSCALING = "LAYA_AOT_RAY_AUTOSCALING"
ENV_ADDRESS = "LAYA_AOT_RAY_ADDRESS"
ENV_MAX_ONGOING = "LAYA_AOT_RAY_MAX_ONGOING"
ENV_PER_GPU = "LAYA_AOT_RAY_PER_GPU"
APP_NAME = "laya-aot"
# what a replica's process needs of this one's environment: every LAYA_* setting and how Python finds laya-aot
PASSED_ON = ("LAYA_", "PYTHONPATH", "TOKENIZERS_", "HF_", "OMP_", "MKL_", "CUDA_")


def build_app() -> Any:
    """The ASGI app of one replica: `laya-aot serve`'s, from the environment Ray gave the replica."""
    from .serve import _setup_logging, create_app

    _setup_logging()
    return create_app()


def _positive(env: Mapping[str, str], name: str, default: int) -> int:
    from .serve import ServeConfigError
    from .serve_workers import number_from_env

    value = number_from_env(env, name, int, 1, None, "a positive integer", ServeConfigError)
    return default if value is None else value


def options(env: Mapping[str, str], gpus: float) -> Dict[str, Any]:
    """The deployment's options from the environment and the cluster's GPUs (checked: one line per mistake)."""
    from .serve import ServeConfigError

    threads = _positive(env, "LAYA_THREADS", 1)
    on_gpu = gpus >= 1 and env.get("LAYA_DEVICE", "").strip().lower() not in ("cpu",)
    per_gpu = _positive(env, ENV_PER_GPU, 1)
    passed = {k: v for k, v in env.items() if k.startswith(PASSED_ON)}
    passed.setdefault("LAYA_THREADS", str(threads))
    opts: Dict[str, Any] = {
        "name": APP_NAME,
        "max_ongoing_requests": _positive(env, ENV_MAX_ONGOING, _positive(env, "LAYA_MAX_CONCURRENT", 16)),
        "ray_actor_options": {"num_cpus": threads, "num_gpus": 1.0 / per_gpu if on_gpu else 0,
                              "runtime_env": {"env_vars": passed}},
    }
    raw = env.get(ENV_AUTOSCALING, "").strip()
    if raw:
        try:
            auto = json.loads(raw)
        except ValueError as e:
            raise ServeConfigError("invalid %s: not JSON (%s); e.g. %s='{\"min_replicas\": 1, \"max_replicas\": 4}'"
                                   % (ENV_AUTOSCALING, e, ENV_AUTOSCALING)) from None
        if not isinstance(auto, dict):
            raise ServeConfigError("invalid %s: a JSON object of Ray Serve's autoscaling_config is needed"
                                   % ENV_AUTOSCALING)
        if env.get(ENV_REPLICAS, "").strip():
            raise ServeConfigError("%s and %s both set: a fixed count or autoscaling, not both; unset one"
                                   % (ENV_REPLICAS, ENV_AUTOSCALING))
        opts["autoscaling_config"] = auto
    else:
        opts["num_replicas"] = _positive(env, ENV_REPLICAS, int(gpus) * per_gpu if on_gpu else 1)
    return opts


def deployment(opts: Dict[str, Any]) -> Any:
    """The Ray Serve deployment: `build_app` evaluated on each replica (laya's app is never pickled)."""
    from ray import serve

    return serve.deployment(**opts)(serve.ingress(build_app)())


def main(argv: Optional[List[str]] = None) -> int:
    """Start (or join) Ray, run the deployment, serve until SIGTERM or Ctrl-C, then take it down."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    from . import laya_internals as laya_api
    from .serve import ServeConfigError, _setup_logging, config_from_env

    _setup_logging()
    try:
        laya_api.require("serve")
        config_from_env()   # every LAYA_AOT_* setting checked here, before Ray starts
        host, port, _ = laya_api.serve_settings()
        import ray
        from ray import serve
    except (ServeConfigError, laya_api.RouteUnavailable) as e:
        print("laya_aot.serve_ray: %s" % e, file=sys.stderr)
        return 2
    except ImportError as e:
        print("laya_aot.serve_ray: Ray Serve is not installed (%s): pip install \"laya-aot[ray,serve]\"" % e,
              file=sys.stderr)
        return 2
    except SystemExit as e:
        if isinstance(e.code, str):
            print("laya_aot.serve_ray: %s" % e.code, file=sys.stderr)
            return 2
        raise
    address = os.environ.get(ENV_ADDRESS, "").strip() or None
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        opts = options(os.environ, float(ray.cluster_resources().get("GPU", 0)))
    except ServeConfigError as e:
        ray.shutdown()
        print("laya_aot.serve_ray: %s" % e, file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    t0 = time.perf_counter()
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(deployment(opts).bind(), name=APP_NAME, route_prefix="/", blocking=False)
        log.info("Ray Serve deployment %r ready in %.1f s on %s:%d: %s", APP_NAME, time.perf_counter() - t0, host,
                 port, ", ".join("%s=%s" % (k, v) for k, v in opts.items() if k != "ray_actor_options"))
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
