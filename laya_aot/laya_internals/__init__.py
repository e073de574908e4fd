"""Everything laya-aot uses of laya beyond `laya.load` and the Agent's public methods: one package to re-check on a
laya upgrade, and the only place in laya-aot that touches laya's private names.

One module per route: `routes.py` (what each route relies on, `check` and `require`), `core.py` (an agent's
backend and module, its facts, the thin agent), `serve.py` (laya's Router and app as `laya-aot serve` takes them
over), `host_path.py` (laya's host-side steps of a call). laya has no public way to install a custom forward, so a
bundle's backend is installed as `set_backend` does it, under the agent's lock. Every name reads through the
package (`from laya_aot import laya_internals as laya_api; laya_api.install_backend(...)`).
"""
from .core import (  # noqa: F401
    AgentWithModel,
    Backend,
    BackendUnavailable,
    _fast_tokenizer,
    accelerated,
    bucket_rows,
    bucket_tokens,
    build_eager_module,
    context_len,
    eager_agent,
    embedding_rows,
    embedding_rows_short,
    guard_laya_switches,
    head_attention_classes,
    install_backend,
    is_thin,
    pad_batch,
    pad_id,
    serving_dtype,
    serving_paused,
    set_model,
    thin_agent,
    vocab,
)
from .host_path import (  # noqa: F401
    build_head,
    decode_helpers,
    decode_numbers,
    encode_texts,
    plain_predict_batch,
    render_options,
    route_decode,
    route_encode_state,
    route_host_path,
    sequence_parts,
    state_encoder,
    state_text,
    stock_decode,
    stock_encode_text,
)
from .routes import (  # noqa: F401
    AGENT_NAMES,
    CORE_NAMES,
    HOST_PATH_NAMES,
    MODULE_NAMES,
    OPTIONAL_NAMES,
    PACKAGES,
    ROUTER_NAMES,
    ROUTES,
    SERVE_NAMES,
    TILELANG_NAMES,
    LayaIncompatible,
    RouteUnavailable,
    check,
    missing_packages,
    require,
)
from .serve import (  # noqa: F401
    APP_CELLS,
    OVERLOAD_DETAIL,
    OVERLOAD_HEADERS,
    OVERLOAD_STATUS,
    aot_router_class,
    app_cells,
    build_router,
    overloaded_error,
    predict_call,
    resident_agent,
    router_agent_kwargs,
    serve_settings,
    with_router,
)

__all__ = ["AGENT_NAMES", "APP_CELLS", "AgentWithModel", "Backend", "BackendUnavailable", "CORE_NAMES",
           "HOST_PATH_NAMES", "LayaIncompatible", "MODULE_NAMES", "OPTIONAL_NAMES", "OVERLOAD_DETAIL",
           "OVERLOAD_HEADERS", "OVERLOAD_STATUS", "PACKAGES", "ROUTER_NAMES", "ROUTES", "RouteUnavailable",
           "SERVE_NAMES", "TILELANG_NAMES", "accelerated", "aot_router_class", "app_cells", "bucket_rows",
           "bucket_tokens", "build_eager_module", "build_head", "build_router", "check", "context_len",
           "decode_helpers", "decode_numbers", "eager_agent", "embedding_rows", "embedding_rows_short",
           "encode_texts", "guard_laya_switches", "head_attention_classes", "install_backend", "is_thin",
           "missing_packages", "overloaded_error", "pad_batch", "pad_id", "plain_predict_batch", "predict_call",
           "render_options", "require", "resident_agent", "route_decode", "route_encode_state", "route_host_path",
           "router_agent_kwargs",
           "sequence_parts", "serve_settings", "serving_dtype", "serving_paused", "set_model", "state_encoder",
           "state_text", "stock_decode", "stock_encode_text", "thin_agent", "vocab", "with_router"]
