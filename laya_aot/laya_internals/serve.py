"""The serve route: laya's Router and HTTP app as `laya-aot serve` takes them over (the Router's one Agent build,
the closure cells of the app the batcher replaces, laya's own settings and answers)."""
from __future__ import annotations

import functools
import threading
import types
from typing import Any, Callable, Dict, Optional, Tuple

from .routes import LayaIncompatible, check


def aot_router_class(build: Callable[[Any, str, Callable[[], Any]], Any]) -> type:
    """A `laya.Router` subclass whose checkpoint builds call `build(router, key, laya_build)`.

    `laya_build()` is laya's own `Router._build` for that key; everything else (lazy loads, LRU eviction,
    unloads, routing) stays laya's.
    """
    from laya.router import Router

    class AotRouter(Router):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            missing = check(router=self, routes=())  # before laya's build_router preloads anything
            if missing:
                raise LayaIncompatible(missing, "laya-aot serve")

        def _build(self, key: str):
            return build(self, key, lambda: Router._build(self, key))

    return AotRouter


_PATCH_LOCK = threading.Lock()


def build_router(router_class: Optional[type]) -> Any:
    """`laya.serve.build_router()` (every `LAYA_*` setting, and the preload) building a `router_class`
    (None: laya's own Router, untouched).

    laya's function constructs `laya.router.Router` by name at call time, so the name points at
    `router_class` for the duration of the call; a laya that builds its Router some other way is reported.
    """
    import laya.router
    import laya.serve

    if router_class is None:
        return laya.serve.build_router()
    with _PATCH_LOCK:
        original = laya.router.Router
        laya.router.Router = router_class
        try:
            router = laya.serve.build_router()
        finally:
            laya.router.Router = original
    if not isinstance(router, router_class):
        raise RuntimeError("this laya's serve.build_router no longer builds laya.router.Router, so laya-aot serve "
                           "cannot route checkpoint loads through bundles: adapt laya_aot/laya_internals/")
    return router


def router_agent_kwargs(router: Any, key: str) -> Dict[str, Any]:
    """What laya's `Router._build` passes to `Agent` for `key`, less where the checkpoint lives (source,
    subfolder, revision, token): the device, the Router's `agent_kwargs` and the merged digest pins."""
    from laya.router import _digest_entry, _merge_expected_digests

    with router._lock:
        kwargs: Dict[str, Any] = {"device": router.device}
        kwargs.update(router.agent_kwargs)
        expected = _merge_expected_digests(kwargs.pop("expected_sha256", None),
                                           _digest_entry(router.sha256_digests, key))
    if expected is not None:
        kwargs["expected_sha256"] = expected
    return kwargs


def resident_agent(router: Any, name: str) -> Any:
    """The agent `router` holds for `name` now, or None; never loads (laya's own /health reader)."""
    from laya.mcp.device import router_agent

    return router_agent(router, name)


# --------------------------------------------------------------------------------- laya's app, concurrently
# laya's `create_app` runs every inference under one asyncio.Lock (`gate`) on a one-thread pool (`pool`): each
# request calls `pool` through `loop.run_in_executor(pool, _run_inference, run)`, where `run` is
# `partial(router.predict, state, questions, **controls)` (a single request), `partial(_predict_with_tournament,
# router, ...)` or the batch route's `_do_batch` closure; its idle reaper submits `_unload_if_idle` to the same
# pool and skips while `gate.locked()`. laya-aot serve's batcher takes over exactly these: the closure cells of
# one app, found from its `/v1/systemone` endpoint, are given a shared gate and a pool that hands inferences to
# the batcher (laya_aot/serve_batching.py). Everything else of the request (auth, admission, body, checks, the
# answer's post-processing, errors) stays laya's code.
APP_CELLS: Tuple[str, ...] = ("gate", "pool", "_run_inference", "router")
OVERLOAD_STATUS, OVERLOAD_DETAIL, OVERLOAD_HEADERS = 503, "server busy, try again later", {"Retry-After": "1"}


def _cells(fn: Any) -> Dict[str, Any]:
    code = getattr(fn, "__code__", None)
    return dict(zip(code.co_freevars, fn.__closure__ or ())) if code is not None else {}


def app_cells(app: Any) -> Optional[Dict[str, Any]]:
    """The closure cells (APP_CELLS) laya's `create_app` made for `app`, each under its name without a leading
    underscore (`gate`, `pool`, `run_inference`, `router`), or None where this laya's app is not built that way
    (then its requests run as laya runs them)."""
    for route in getattr(app, "routes", ()):
        if getattr(route, "path", None) == "/v1/systemone" and "POST" in (getattr(route, "methods", None) or ()):
            inner = _cells(route.endpoint).get("_systemone_inner")
            cells = _cells(getattr(inner, "cell_contents", None))
            if all(name in cells for name in APP_CELLS):
                return {name.lstrip("_"): cells[name] for name in APP_CELLS}
    return None


def predict_call(run: Any, router: Any) -> Optional[Tuple[Any, Any, Dict[str, Any]]]:
    """(state, questions, controls) when `run` is laya's single request, `partial(router.predict, state, questions,
    **controls)`; else None."""
    if isinstance(run, functools.partial) and len(run.args) == 2 and getattr(run.func, "__self__", None) is router \
            and getattr(run.func, "__name__", None) == "predict":
        return run.args[0], run.args[1], dict(run.keywords)
    return None


def with_router(run: Any, router: Any, proxy: Any) -> Optional[Callable[[], Any]]:
    """`run` (a partial or a closure laya made for one request) with `router` replaced by `proxy` wherever it holds
    it: a bound method of it, an argument, a closure cell (the batch route's `_do_batch` reads the app's router
    cell, which this gives a cell of its own). None when `run` holds no reference to `router`."""
    if isinstance(run, functools.partial):
        func = run.func
        if getattr(func, "__self__", None) is router:
            func = getattr(proxy, func.__name__)
        held = any(a is router for a in run.args) or any(v is router for v in run.keywords.values())
        if func is run.func and not held:
            return None
        args = tuple(proxy if a is router else a for a in run.args)
        kwargs = {k: proxy if v is router else v for k, v in run.keywords.items()}
        return functools.partial(func, *args, **kwargs)
    code = getattr(run, "__code__", None)
    if code is None or not run.__closure__:
        return None

    def holds(cell: Any) -> bool:
        try:
            return cell.cell_contents is router
        except ValueError:  # an empty cell
            return False

    if not any(holds(c) for c in run.__closure__):
        return None
    cells = tuple(types.CellType(proxy) if holds(c) else c for c in run.__closure__)
    return types.FunctionType(code, run.__globals__, run.__name__, run.__defaults__, cells)


def overloaded_error() -> Any:
    """laya's own answer to a request its admission bound (LAYA_MAX_CONCURRENT) refuses: 503, the same detail and
    Retry-After (tests/serve/test_batching.py compares it with laya's)."""
    from fastapi import HTTPException

    return HTTPException(status_code=OVERLOAD_STATUS, detail=OVERLOAD_DETAIL, headers=dict(OVERLOAD_HEADERS))


def serve_settings() -> Tuple[str, int, str]:
    """Host, port and uvicorn log level from LAYA_HOST, LAYA_PORT, LAYA_LOG_LEVEL, read as `laya serve` reads
    them (a bad port or level is a SystemExit with laya's message)."""
    import os

    from laya.serve import _resolve_log_level, _resolve_port

    return os.environ.get("LAYA_HOST", "0.0.0.0"), _resolve_port(), _resolve_log_level()
