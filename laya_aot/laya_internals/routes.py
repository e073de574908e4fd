"""What laya-aot relies on of laya, route by route, and the checks that it is there.

A route is one way laya-aot uses laya: core (`laya_aot.load`, the build, every backend), serve (`laya-aot serve`),
tilelang (TileLang kernels and artifacts), host_path (runtime/host_path.py). Each names the (module, attribute)
pairs it needs; `check(routes=...)` lists what this laya lacks, `require` names the extra a route's packages come
with. This table is what to re-check on a laya upgrade.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Dict, List, Tuple

from ..errors import LayaAotError

# (module, attribute path) pairs laya-aot needs, grouped by the route that needs them: a route's names are
# checked only when that route runs, so a laya installed without an optional extra still serves the others
CORE_NAMES: Tuple[Tuple[str, str], ...] = (  # laya_aot.load, the build, every backend
    ("laya", "load"),
    ("laya.agent", "Agent.deaccelerate"),
    ("laya.agent", "Agent._restore_runtime"),   # the end of laya's retry on the CPU (EagerModule)
    ("laya.agent", "Agent._infer"),      # offers the collated batch on the host to the backend (install_backend)
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
    ("laya.agent", "collate_items"),     # wrapped: predict_batch's collation, its arrays filled at once
    ("laya.common", "_TOKENIZE_LOCK"),   # held by the direct tokenizer call (state_encoder), as laya holds it
    ("laya.agent", "Agent._encode_state"),  # a host-path agent's: its items from the call's question heads
    ("laya.common", "build_sequence"),   # ... assembled as build_sequence assembles them (the test compares)
    ("laya.agent", "Agent._decode_answers"),  # a host-path agent's: runtime/host_steps.Decoder, equal answers
    ("laya.agent", "apply_binning_map"),  # ... which calls laya's binning, bucket and legend functions as it does
    ("laya.agent", "temp_bucket"),
    ("laya.agent", "QTYPES"),
    ("laya.agent", "render_criterion"),
    ("laya.agent", "answer_confidence"),
    ("laya.agent", "confidence_from_probs"),
    ("laya.agent", "unpermute_probs"),
    ("laya.agent", "Agent.predict_batch"),  # a plain call computed as this laya's method (plain_predict_batch) ...
    ("laya.agent", "Agent._check_question"),  # ... with its own validation, normalisation and forward
    ("laya.agent", "Agent._to_internal"),
    ("laya.agent", "Agent._forward"),
    ("laya.agent", "_reuse_question_tokens"),  # ... under its decorators
    ("laya.agent", "_disable_question_token_reuse"),
    ("laya.agent", "collapsed_options"),
    ("laya.hooks", "_DEFAULT_HOOKS"),  # ... when no hook is set anywhere
)
ROUTES: Dict[str, Tuple[Tuple[str, str], ...]] = {"core": CORE_NAMES, "serve": SERVE_NAMES,
                                                   "tilelang": TILELANG_NAMES, "host_path": HOST_PATH_NAMES}
# the third-party packages a route imports through laya, and the extra of laya-aot that installs them
PACKAGES: Dict[str, Tuple[str, ...]] = {"serve": ("fastapi", "uvicorn"), "tilelang": ("tilelang",)}
_ROUTE_WORDS: Dict[str, str] = {"serve": "laya-aot serve", "tilelang": "TileLang (its kernels and artifacts)"}
MODULE_NAMES: Tuple[Tuple[str, str], ...] = CORE_NAMES + SERVE_NAMES + TILELANG_NAMES + HOST_PATH_NAMES  # every route
AGENT_NAMES: Tuple[str, ...] = ("_gate", "_backend", "_fast", "_compiled", "tok", "model", "device", "dtype",
                                 "amp_enabled")
# what `router_agent_kwargs` reads of a Router, as Router._build does
ROUTER_NAMES: Tuple[str, ...] = ("_lock", "_agents", "device", "agent_kwargs", "sha256_digests")
# private names used only where this laya has them; without them laya's own code runs (not checked): laya 0.4's head
# attention class (core.head_attention_classes) and the closure of laya's /v1/systemone endpoint (serve.app_cells)
OPTIONAL_NAMES: Tuple[str, ...] = ("_DynamicMultiheadAttention", "_systemone_inner")


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
