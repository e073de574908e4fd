"""Everything laya-aot uses of laya beyond `laya.load` and the Agent's public methods: one module to
re-check on a laya upgrade.

laya has no public way to install a custom forward, so a bundle's backend is installed as `set_backend`
does it, under the agent's lock. `check(routes=...)` lists the names a route (core, serve, tilelang)
relies on that this laya lacks and `require` names the extra a route needs; `aot_router_class` and
`build_router` are the seam through which `laya-aot serve` takes over laya's `Router._build`.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
import types
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from laya.backends.base import Backend, BackendUnavailable, bucket_rows, bucket_tokens, pad_batch

from ..dtypes import name_of
from ..errors import LayaAotError

# (module, attribute path) pairs laya-aot needs, grouped by the route that needs them: a route's names are
# checked only when that route runs, so a laya installed without an optional extra still serves the others
CORE_NAMES: Tuple[Tuple[str, str], ...] = (  # laya_aot.load, the build, every backend
    ("laya", "load"),
    ("laya.agent", "Agent.deaccelerate"),
    ("laya.agent", "Agent._restore_runtime"),   # the end of laya's retry on the CPU (EagerModule)
    ("laya.backends.base", "Backend.install"),
    ("laya.backends.base", "Backend.stock_forward"),
    ("laya.backends.base", "BackendUnavailable"),
    ("laya.backends.base", "pad_batch"),
    ("laya.backends.base", "bucket_rows"),
    ("laya.backends.base", "bucket_tokens"),
    ("laya.common", "build_model"),
    ("laya.agent", "build_model"),       # the thin agent replaces it with a shell while laya builds an Agent
    ("laya.agent", "_load_tokenizer"),   # ... and loads the fast tokenizer class directly, into laya's cache
    ("laya.agent", "_TOKENIZERS"),
    ("laya.agent", "_TOKENIZERS_LOCK"),
)
SERVE_NAMES: Tuple[Tuple[str, str], ...] = (  # laya-aot serve: laya's app and settings, the Router's one Agent build
    ("laya.serve", "build_router"),
    ("laya.serve", "create_app"),
    ("laya.serve", "_resolve_port"),
    ("laya.serve", "_resolve_log_level"),
    ("laya.router", "Router._build"),
    ("laya.router", "_merge_expected_digests"),
    ("laya.router", "_digest_entry"),
    ("laya.mcp.device", "router_agent"),
)
TILELANG_NAMES: Tuple[Tuple[str, str], ...] = (  # TileLang artifacts and builds (laya_aot.kernels)
    ("laya.fast", "FastLaya"),           # laya_aot.kernels drives laya's fast path with precompiled kernels
    ("laya.tl_kernels", "gemm_kernel"),  # and hooks its kernel factories (kernels.catalogue.FACTORIES)
)
HOST_PATH_NAMES: Tuple[Tuple[str, str], ...] = (  # runtime/host_path.py: laya's host path with its own caches
    ("laya.common", "build_head"),       # wrapped: a question's head, cached across calls
    ("laya.common", "render_options"),   # ... keyed by the options as build_head renders them
    ("laya.common", "serialize_state"),  # a state's text, as Agent._encode_state makes it
    ("laya.common", "encode_text"),      # laya's tokenizer call under its lock
    ("laya.agent", "encode_text"),       # wrapped: Agent._encode_state's state tokenisation
    ("laya.common", "_TOKENIZE_LOCK"),   # held by the direct tokenizer call (state_encoder), as laya holds it
    ("laya.agent", "Agent._decode_answers"),  # a host-path agent's: runtime/host_steps.Decoder, equal answers
    ("laya.agent", "apply_binning_map"),  # ... which calls laya's binning, bucket and legend functions as it does
    ("laya.agent", "temp_bucket"),
    ("laya.agent", "QTYPES"),
    ("laya.agent", "render_criterion"),
    ("laya.agent", "answer_confidence"),
    ("laya.agent", "confidence_from_probs"),
    ("laya.agent", "unpermute_probs"),
)
ROUTES: Dict[str, Tuple[Tuple[str, str], ...]] = {"core": CORE_NAMES, "serve": SERVE_NAMES,
                                                   "tilelang": TILELANG_NAMES, "host_path": HOST_PATH_NAMES}
# the third-party packages a route imports through laya, and the extra of laya-aot that installs them
PACKAGES: Dict[str, Tuple[str, ...]] = {"serve": ("fastapi", "uvicorn"), "tilelang": ("tilelang",)}
_ROUTE_WORDS: Dict[str, str] = {"serve": "laya-aot serve", "tilelang": "TileLang (its kernels and artifacts)"}
MODULE_NAMES: Tuple[Tuple[str, str], ...] = CORE_NAMES + SERVE_NAMES + TILELANG_NAMES + HOST_PATH_NAMES  # every route
AGENT_NAMES: Tuple[str, ...] = ("_gate", "_backend", "_fast", "tok", "model", "device", "dtype", "amp_enabled")
# what `router_agent_kwargs` reads of a Router, as Router._build does
ROUTER_NAMES: Tuple[str, ...] = ("_lock", "_agents", "device", "agent_kwargs", "sha256_digests")


class RouteUnavailable(LayaAotError, RuntimeError):
    """A route's optional packages are not installed; the message is one line naming the extra to install."""


class LayaIncompatible(LayaAotError, RuntimeError):
    """This laya lacks names a route relies on; the message names them and the fix."""

    def __init__(self, missing: List[str], who: str):
        super().__init__("this laya lacks %s, which %s relies on: install a laya laya-aot supports (pip install "
                         "\"laya>=0.4.15,<0.5\"), or adapt laya_aot/laya_internals/ to it"
                         % (", ".join(missing), who))
        self.missing = missing


def missing_packages(route: str) -> List[str]:
    """The packages `route` needs that are not installed (found without importing them: no start-up cost)."""
    return [name for name in PACKAGES.get(route, ()) if importlib.util.find_spec(name) is None]


def require(*routes: str) -> None:
    """Raise RouteUnavailable naming the extra when a route's packages are missing, before anything loads.

    Only packages are checked here; `check()` then finds what a laya lacks by name."""
    for route in routes:
        absent = missing_packages(route)
        if absent:
            raise RouteUnavailable("%s needs %s, which %s not installed: pip install \"laya-aot[%s]\""
                                   % (_ROUTE_WORDS.get(route, route), ", ".join(absent),
                                      "is" if len(absent) == 1 else "are", route))


def check(agent: Any = None, router: Any = None, routes: Tuple[str, ...] = ("core",)) -> List[str]:
    """The names of `routes` (core, serve, tilelang) that this laya lacks (empty when all are there).

    A route whose packages are missing is not checked: `require` reports that as the extra to install."""
    missing = []
    if router is not None:
        missing += ["Router.%s" % n for n in ROUTER_NAMES if not hasattr(router, n)]
    for route in routes:
        if missing_packages(route):
            continue
        for module, path in ROUTES[route]:
            try:
                obj: Any = importlib.import_module(module)
                for part in path.split("."):
                    obj = getattr(obj, part)
            except (ImportError, AttributeError):
                missing.append("%s.%s" % (module, path))
    if agent is not None:
        missing += ["Agent.%s" % n for n in AGENT_NAMES if not hasattr(agent, n)]
        gate = getattr(agent, "_gate", None)
        if gate is not None and not hasattr(gate, "write_lock"):
            missing.append("Agent._gate.write_lock")
    return missing


def install_backend(agent: Any, backend: Backend) -> None:
    """Make `backend` the agent's forward, as laya's own `set_backend` swaps backends: under its write lock.

    A backend made on another module than the agent's (a hand-over to an artifact that runs laya's own module,
    built while another artifact served) brings that module along: the agent takes it in the same locked step,
    so no call sees the new module without its backend."""
    with agent._gate.write_lock():
        type(agent).deaccelerate(agent)  # laya's own: a thin agent's guard (EagerModule) would build laya's module
        if backend.model is not agent.model:
            agent.model = backend.model
        backend.install()
        agent._backend = backend
        agent._fast = None


def serving_paused(agent: Any) -> ContextManager[None]:
    """laya's write lock on the agent's forward (`Agent._gate`, as `install_backend` takes it): inside, no forward
    of the agent runs and none begins. A hand-over holds it while the artifact taking over makes its first calls
    (runtime/loader.py): they may capture CUDA graphs in torch's global mode (laya's fast path), which a serving
    forward's allocation or synchronising call on another thread would break, failing both."""
    return agent._gate.write_lock()


_HOST_ROUTED = threading.Lock()


def route_host_path(head: Callable[[Callable], Callable], state: Callable[[Callable], Callable]) -> None:
    """Send laya's `build_head` and `Agent._encode_state`'s tokenizer call through `head(stock)` and `state(stock)`
    (runtime/host_path.py), once per process. Both return laya's stock function's result outside a host path's
    call, so other agents in the process run exactly as before."""
    import laya.agent
    import laya.common

    with _HOST_ROUTED:
        if getattr(laya.common.build_head, "laya_aot_stock", None) is None:
            wrapped = head(laya.common.build_head)
            wrapped.laya_aot_stock = laya.common.build_head  # type: ignore[attr-defined]
            laya.common.build_head = wrapped
        if getattr(laya.agent.encode_text, "laya_aot_stock", None) is None:
            wrapped = state(laya.agent.encode_text)
            wrapped.laya_aot_stock = laya.agent.encode_text  # type: ignore[attr-defined]
            laya.agent.encode_text = wrapped


def stock_decode(agent: Any) -> Callable:
    """laya's `Agent._decode_answers` bound to `agent` (whatever the instance holds in its place)."""
    import laya.agent

    return laya.agent.Agent._decode_answers.__get__(agent)


def decode_helpers() -> Tuple[Callable, Callable, Dict[str, int], Callable]:
    """(apply_binning_map, temp_bucket, QTYPES, render_criterion) as `Agent._decode_answers` calls them."""
    import laya.agent

    return laya.agent.apply_binning_map, laya.agent.temp_bucket, laya.agent.QTYPES, laya.agent.render_criterion


def decode_numbers() -> Tuple[Callable, Callable, Callable]:
    """(answer_confidence, confidence_from_probs, unpermute_probs): the functions `_decode_answers` computes with."""
    import laya.agent

    return laya.agent.answer_confidence, laya.agent.confidence_from_probs, laya.agent.unpermute_probs


def state_encoder(tok: Any) -> Optional[Callable[[List[str]], Optional[List[List[int]]]]]:
    """`encode(texts)`: exactly `tok(texts, add_special_tokens=False)["input_ids"]`, from the tokenizer's Rust
    backend directly (its `encode_batch_fast`, which skips the offsets nobody reads here), or None (the answer
    is laya's call; this tokenizer's class is not one whose call is known to be that).

    The call is known for two classes: laya-aot's `SnapshotTokenizer` (its plain call is `encode_batch` on its
    backend) and transformers' fast tokenizer class itself (its `_encode_plus` resets the backend's truncation
    and padding and sets `encode_special_tokens` to `split_special_tokens`, then calls `encode_batch`). `encode`
    runs under laya's tokenizer lock and answers None, leaving the call to laya, when the backend is not in the
    state that call would run `encode_batch` in (truncation or padding left on by an earlier call, another
    special-token setting): it never changes the shared backend."""
    import sys

    from ..tokenizer_snapshot import SnapshotTokenizer

    if type(tok) is SnapshotTokenizer:
        if not tok.__dict__.get("_right"):  # its plain call then goes to the real tokenizer
            return None
        backend = tok.__dict__.get("_backend")
        want = None  # the snapshot's call never changes its backend's setting
    else:
        module = sys.modules.get("transformers.tokenization_utils_tokenizers")
        fast_class = getattr(module, "TokenizersBackend", None) or getattr(module, "PreTrainedTokenizerFast", None)
        if fast_class is None or type(tok) is not fast_class:
            return None
        backend = tok.__dict__.get("_tokenizer")
        want = bool(getattr(tok, "split_special_tokens", False))
    run = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
    if run is None:
        return None
    from laya.common import _TOKENIZE_LOCK

    def encode(texts: List[str]) -> Optional[List[List[int]]]:
        with _TOKENIZE_LOCK:
            if backend.truncation is not None or backend.padding is not None \
                    or (want is not None and backend.encode_special_tokens != want):
                return None
            encs = run(texts, add_special_tokens=False)
        return [e.ids for e in encs]

    return encode


def render_options(q: Dict[str, Any]) -> List[str]:
    """A normalised question's option texts, as laya's build_head renders them."""
    from laya.common import render_options as stock

    return stock(q)


def state_text(tok: Any, state: Any) -> str:
    """The text `Agent._encode_state` tokenises for `state`."""
    from laya.common import serialize_state

    return serialize_state(state).replace(tok.mask_token, " ")


def encode_texts(tok: Any, texts: List[str]) -> List[List[int]]:
    """`texts` tokenised as `Agent._encode_state` tokenises a state, in one batched call under laya's lock."""
    from laya.common import encode_text

    return encode_text(tok, texts, add_special_tokens=False)["input_ids"]


def head_attention_classes() -> Tuple[type, ...]:
    """The self-attention classes of laya's decision head whose eval maths is `nn.MultiheadAttention`'s without
    weights: laya 0.4's `_DynamicMultiheadAttention` (the same parameters and `scaled_dot_product_attention`, its
    projections on tokens x rows) and the stock class."""
    classes: Tuple[type, ...] = (torch.nn.MultiheadAttention,)
    try:
        from laya.common import _DynamicMultiheadAttention
    except ImportError:  # another laya: its class is not known to compute the same thing
        return classes
    return classes + (_DynamicMultiheadAttention,)


def pad_id(agent: Any) -> int:
    return int(agent.tok.pad_token_id or 0)


def vocab(agent: Any) -> int:
    """Token ids that are safe to feed: the encoder's embedding rows that the tokenizer can produce (a thin
    agent's shell carries the encoder's config.json as a namespace)."""
    return min(int(agent.model.encoder.config.vocab_size), len(agent.tok))


def embedding_rows(agent: Any) -> Optional[int]:
    """The encoder's embedding rows (None: a stand-in agent with no encoder config)."""
    rows = getattr(getattr(getattr(agent.model, "encoder", None), "config", None), "vocab_size", None)
    return None if rows is None else int(rows)


def embedding_rows_short(agent: Any) -> Optional[int]:
    """The encoder's embedding rows when laya's tokenizer can make ids past them (tokens added to the tokenizer
    without resizing the embeddings, or a special token laya inserts with an id past them), else None (also for a
    stand-in agent with no encoder or tokenizer)."""
    rows = embedding_rows(agent)
    tok = getattr(agent, "tok", None)
    if rows is None or tok is None:
        return None
    ids = [getattr(tok, name, None) for name in ("cls_token_id", "sep_token_id", "mask_token_id", "pad_token_id")]
    if len(tok) > rows or any(i is not None and not 0 <= i < rows for i in ids):
        return rows
    return None


def context_len(agent: Any) -> int:
    """The most tokens laya puts in one row for this checkpoint: its max_len (laya's default 512)."""
    return int(agent.cfg.get("max_len", 512))


def parallel_options(agent: Any) -> bool:
    return bool(getattr(agent, "parallel_options", False))


def serving_dtype(agent: Any) -> str:
    """The precision laya runs this agent's forward in: its autocast dtype when on, else fp32."""
    if not getattr(agent, "amp_enabled", False):
        return "fp32"
    return name_of(agent.dtype)


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
    """The closure cells (APP_CELLS) laya's `create_app` made for `app`, or None where this laya's app is not built
    that way (then its requests run as laya runs them)."""
    for route in getattr(app, "routes", ()):
        if getattr(route, "path", None) == "/v1/systemone" and "POST" in (getattr(route, "methods", None) or ()):
            inner = _cells(route.endpoint).get("_systemone_inner")
            cells = _cells(getattr(inner, "cell_contents", None))
            if all(name in cells for name in APP_CELLS):
                return {name: cells[name] for name in APP_CELLS}
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



# ---------------------------------------------------------------------------------------- the thin agent
# laya's Agent.__init__ builds the whole eager DecisionModel (importing transformers' modelling code, building the
# encoder in fp32), reads every weight into it and moves it to the device: seconds of a large checkpoint's start,
# all of it wasted when an artifact serves. `thin_agent` runs that same __init__ (tokenizer, config,
# temperatures, calibration, device and autocast policy: everything but the forward stays laya's) with the model
# a shell: a module tree of meta tensors named and shaped as the checkpoint's weights, read from the
# safetensors header. `Agent.__init__` looks up `build_model` and `_load_tokenizer` in laya.agent and `load_file`
# in safetensors.torch at call time; each is wrapped once, and the wrappers change nothing unless the calling
# thread is inside `thin_agent`.
_THIN = threading.local()
_HOOKS_LOCK = threading.Lock()
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _meta_weights(filename: Any) -> Dict[str, torch.Tensor]:
    """The checkpoint's tensors as meta tensors of their shapes and dtypes: its header, not its bytes."""
    from safetensors import safe_open

    with safe_open(str(filename), framework="pt") as f:
        out = {}
        for key in f.keys():
            s = f.get_slice(key)
            out[key] = torch.empty(s.get_shape(), dtype=_SAFETENSORS_DTYPES.get(s.get_dtype(), torch.float32),
                                   device="meta")
    return out


def _shell(weights: Dict[str, torch.Tensor], encoder_dir: Optional[str]) -> torch.nn.Module:
    """A module tree whose parameters are `weights` (meta tensors) under their names; `encoder.config` holds the
    encoder's config.json. laya checks it against the checkpoint and places it; only the artifact computes."""
    import json
    import os
    import types

    root = torch.nn.Module()
    for name, t in weights.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    config: Dict[str, Any] = {}
    if encoder_dir and os.path.exists(os.path.join(encoder_dir, "config.json")):
        with open(os.path.join(encoder_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    if "encoder" in root._modules:
        root._modules["encoder"].config = types.SimpleNamespace(**config)
    # laya places the model with .to(device): a shell has nothing to place
    root.__dict__["to"] = lambda *a, **k: root
    return root


# The tokenizer classes `AutoTokenizer` resolves to the fast tokenizers backend (after laya's own
# `_fix_tokenizer_config`). Importing `AutoTokenizer` imports transformers' modelling and generation code
# (torch.distributed, torch._dynamo: seconds of every start); importing the class it resolves to does not.
_FAST_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _fast_tokenizer(tok_dir: str) -> Any:
    """The tokenizer `AutoTokenizer.from_pretrained(tok_dir)` returns, loaded by the class it resolves to, or
    None where that class is not the fast tokenizers backend (anything else goes through laya's own path)."""
    import json
    import os

    try:
        with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            tcfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(tcfg, dict) or tcfg.get("tokenizer_class") not in _FAST_TOKENIZER_CLASSES \
            or tcfg.get("auto_map") or not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        return None
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tok_dir)


def _install_thin_hooks() -> None:
    import laya.agent
    import safetensors.torch

    from .. import tokenizer_snapshot

    with _HOOKS_LOCK:
        if getattr(laya.agent.build_model, "_laya_aot_thin", False):
            return
        build_original = laya.agent.build_model
        load_original = safetensors.torch.load_file
        tokenizer_original = laya.agent._load_tokenizer

        def load_tokenizer(tok_dir: str, cfg: Dict) -> Any:
            """laya's `_load_tokenizer`, sharing its per-process cache, with the fast class loaded directly."""
            import os

            if not getattr(_THIN, "on", False) or not os.path.isdir(tok_dir):
                return tokenizer_original(tok_dir, cfg)
            try:
                stamp = (os.path.abspath(tok_dir), os.path.getmtime(os.path.join(tok_dir, "tokenizer_config.json")))
            except OSError:
                return tokenizer_original(tok_dir, cfg)
            ready = getattr(_THIN, "before_tokenizer", None)
            if ready is not None:  # the loader's say on the bundle's snapshot (`runtime/loader._Seed`) comes first
                ready()
            snap = tokenizer_snapshot.load(tok_dir, lambda: tokenizer_original(tok_dir, cfg))
            if snap is not None:
                return snap
            with laya.agent._TOKENIZERS_LOCK:
                cached = laya.agent._TOKENIZERS.get(stamp)
                if cached is None:
                    cached = _fast_tokenizer(tok_dir)
                    if cached is not None:
                        laya.agent._TOKENIZERS[stamp] = cached
            real = cached if cached is not None else tokenizer_original(tok_dir, cfg)
            tokenizer_snapshot.store(tok_dir, real)  # the next start on this machine skips transformers
            return real

        def build_model(cfg: Any, encoder_dir: Optional[str] = None, *args: Any, **kwargs: Any):
            if not getattr(_THIN, "on", False):
                return build_original(cfg, encoder_dir, *args, **kwargs)
            return _shell(_meta_weights(_THIN.weights), encoder_dir)

        def load_file(filename: Any, device: Any = "cpu"):
            if not getattr(_THIN, "on", False):
                return load_original(filename, device)
            return _meta_weights(filename)

        build_model._laya_aot_thin = True  # type: ignore[attr-defined]
        laya.agent.build_model = build_model
        safetensors.torch.load_file = load_file
        laya.agent._load_tokenizer = load_tokenizer


def thin_agent(checkpoint: str, before_tokenizer: Optional[Callable[[], None]] = None, **kwargs: Any) -> Any:
    """A `laya.Agent` made by laya's own constructor whose model is a shell of meta tensors (no weights read).

    Its forward must be replaced (an artifact's backend) before any call; `build_eager_module` makes the
    real module when laya's eager forward is needed. `before_tokenizer` is called (in this thread) just before
    the agent's tokenizer is looked up."""
    import os

    import laya

    _install_thin_hooks()
    _THIN.on, _THIN.weights = True, os.path.join(checkpoint, "model.safetensors")
    _THIN.before_tokenizer = before_tokenizer
    try:
        agent = laya.load(checkpoint, **kwargs)
    finally:
        _THIN.on, _THIN.before_tokenizer = False, None
    agent.model.__dict__.pop("to", None)
    return agent


def accelerated(load_kwargs: Dict[str, Any]) -> bool:
    """Whether `laya.load` keyword arguments ask for one of laya's own accelerations (they replace the forward
    themselves, on laya's whole module)."""
    return any(load_kwargs.get(k) for k in ("fast", "compile", "backend"))


def is_thin(agent: Any) -> bool:
    """Whether the agent's model is a shell of meta tensors (made by `thin_agent`)."""
    p = next(iter(agent.model.parameters()), None)
    return p is not None and p.device.type == "meta"


def build_eager_module(agent: Any, checkpoint: str, device: Optional[torch.device] = None) -> torch.nn.Module:
    """laya's eager DecisionModel for `agent`, bitwise what `Agent.__init__` builds and places, without its copies.

    laya's own `build_model` makes the module: its classes, its config, and its non-persistent buffers (such as
    ModernBERT's RoPE frequencies) computed on the CPU as laya computes them. It initialises no parameter, so
    their CPU memory is allocated and never written. The weights then go from the file straight to the agent's
    device in a few large copies, each tensor converted there to the dtype laya's module holds (fp32: exact from
    the fp16 or bf16 the file holds; `checkpoint.Weights.load_to`, the artifacts' own reader), and are assigned to
    the module by laya's strict load (`load_state_dict(strict=True, assign=True)`, its errors included), instead
    of being copied into fp32 CPU tensors that `.to(device)` copies again. That `.to` now moves the buffers only,
    as laya's moves them. `device`: where the module goes (None: the agent's device)."""
    import os

    from laya.common import build_model

    from ..checkpoint import Weights

    enc_dir = os.path.join(checkpoint, "encoder")
    model = build_model(agent.cfg, encoder_dir=enc_dir if os.path.exists(enc_dir) else None, pretrained=False)
    device = torch.device(agent.device if device is None else device)
    like = model.state_dict()
    file = Weights(checkpoint)
    weights: Dict[str, Any] = file.load_to({k: like[k].dtype for k in file if k in like}, device)
    weights.update({k: file[k] for k in file if k not in like})   # unexpected: for the strict load to name
    shared = _shared_tensors(model)
    model.load_state_dict(weights, strict=True, assign=True)
    _retie(model, shared)
    try:
        model.encoder.config.reference_compile = False
    except Exception:  # noqa: BLE001 - laya itself treats this setting as best effort
        pass
    return model.to(device).eval()


def eager_agent(checkpoint: str, **kwargs: Any) -> Any:
    """The agent `laya.load(checkpoint, **kwargs)` returns, its module built by `build_eager_module` (a thin agent
    given laya's module, as the loader gives it to one): for a child that runs laya's module on the real weights.
    Unlike `laya.load`, a device without room for the module raises (as in the loader) instead of falling back to
    the CPU. With one of laya's accelerations (`fast=`, `compile=`, `backend=`): `laya.load` itself."""
    if accelerated(kwargs):
        import laya

        return laya.load(checkpoint, **kwargs)
    agent = thin_agent(checkpoint, **kwargs)
    set_model(agent, build_eager_module(agent, checkpoint))
    return agent


def _shared_tensors(model: torch.nn.Module) -> List[List[Tuple[torch.nn.Module, str, bool]]]:
    """Groups of (module, name, is_parameter) registering one tensor object under several names, ordered by when
    `load_state_dict` last visits each (none in laya 0.4's DecisionModel; tied weights in a future one)."""
    seen: Dict[int, Dict[Tuple[int, str], Tuple[torch.nn.Module, str, bool]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):   # load_state_dict's walk: shared modules too
        for is_param, table in ((True, module._parameters), (False, module._buffers)):
            for name, t in table.items():
                if t is not None:
                    places = seen.setdefault(id(t), {})
                    places.pop((id(module), name), None)
                    places[(id(module), name)] = (module, name, is_param)
    return [list(places.values()) for places in seen.values() if len(places) > 1]


def _retie(model: torch.nn.Module, shared: List[List[Tuple[torch.nn.Module, str, bool]]]) -> None:
    """Make each group one tensor again after an assigning load, as a copying load leaves it: the one object,
    holding the value of the name loaded last."""
    for group in shared:
        last_module, last_name, is_param = group[-1]
        table = "_parameters" if is_param else "_buffers"
        keep = getattr(last_module, table)[last_name]
        for module, name, _ in group[:-1]:
            getattr(module, table)[name] = keep


class AgentWithModel:
    """`agent` with `model` in place of its own, read-only: what an artifact's load reads (laya's fast path reads
    the agent's model, dtype and config) while the agent itself keeps serving with its own model."""

    def __init__(self, agent: Any, model: torch.nn.Module):
        self.__dict__.update(_agent=agent, model=model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_agent"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("AgentWithModel is read-only (%s)" % name)


def set_model(agent: Any, model: torch.nn.Module) -> None:
    """Make `model` the agent's module (no backend may be installed yet), under laya's write lock."""
    with agent._gate.write_lock():
        agent.model = model


__all__ = ["AgentWithModel", "Backend", "BackendUnavailable", "LayaIncompatible", "RouteUnavailable",
           "aot_router_class", "bucket_rows",
           "accelerated", "bucket_tokens", "build_eager_module", "build_router", "check", "eager_agent",
           "embedding_rows", "embedding_rows_short", "head_attention_classes",
           "install_backend", "is_thin",
           "missing_packages", "pad_batch", "pad_id", "parallel_options", "require", "resident_agent",
           "router_agent_kwargs", "serve_settings", "serving_dtype", "serving_paused", "set_model",
           "thin_agent", "vocab"]
