"""The core route: an agent's backend and module (installed under laya's write lock), the facts laya-aot reads of
an agent, and the thin agent (laya's own constructor with the model a shell of meta tensors) with the eager module
built for it. What `laya_aot.load`, the build and every backend use of laya's internals.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from laya.backends.base import Backend, BackendUnavailable, bucket_rows, bucket_tokens, pad_batch

from ..checkpoint import WEIGHTS_FILE, Weights
from ..numerics.dtypes import name_of


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
        _route_infer(agent)


def _route_infer(agent: Any) -> None:
    """On this agent only (once): laya's `_infer(b)` first offers the collated batch, still on the host, to the
    installed backend's `host_call(b)` under laya's read lock, as laya's own forward runs. Its answer is the
    outputs on the host, or None; then, and on any RuntimeError (running out of memory among them), laya's own
    `_infer` runs the batch: its device copies, autocast, retry on the CPU. A backend without `host_call`, laya's
    fast or compiled forward, and the parallel option layout are always laya's."""
    if "_infer" in agent.__dict__:
        return
    stock = agent._infer

    @functools.wraps(stock)
    def infer(b: Dict[str, Any]) -> Any:
        if "option_ids" in b:
            return stock(b)
        try:
            with agent._gate.read_lock():  # the backend read under it: a hand-over swaps it under the write lock
                host_call = getattr(agent._backend, "host_call", None)
                laya_own = host_call is None or agent._fast is not None or agent._compiled
                out = None if laya_own else host_call(b)
        except RuntimeError:
            return stock(b)
        return stock(b) if out is None else out

    agent.__dict__["_infer"] = infer


def guard_laya_switches(agent: Any, before: Callable[[str, Callable[..., Any]], Callable[..., Any]],
                        retry_ended: Callable[[Any, Any, bool], bool]) -> None:
    """On this agent only: laya's `set_backend`, `accelerate` and `deaccelerate` become `before(name, stock)`, and
    the end of laya's retry of a request on the CPU after an out-of-memory (its `_restore_runtime(device, dtype,
    amp_enabled, had_fast)`, which moves the agent's module back to the device) first asks
    `retry_ended(device, dtype, amp_enabled)`: True means it put the agent back itself, and laya's own end is
    skipped (runtime/eager_module.py)."""
    for name in ("set_backend", "accelerate", "deaccelerate"):
        agent.__dict__[name] = before(name, getattr(agent, name))
    stock = agent._restore_runtime

    @functools.wraps(stock)
    def restore(device: Any, dtype: Any, amp_enabled: bool, had_fast: bool) -> Any:
        if retry_ended(device, dtype, amp_enabled):
            return None
        return stock(device, dtype, amp_enabled, had_fast)

    agent.__dict__["_restore_runtime"] = restore


def serving_paused(agent: Any) -> ContextManager[None]:
    """laya's write lock on the agent's forward (`Agent._gate`, as `install_backend` takes it): inside, no forward
    of the agent runs and none begins. A hand-over holds it while the artifact taking over makes its first calls
    (runtime/loader.py): they may capture CUDA graphs in torch's global mode (laya's fast path), which a serving
    forward's allocation or synchronising call on another thread would break, failing both."""
    return agent._gate.write_lock()


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


def serving_dtype(agent: Any) -> str:
    """The precision laya runs this agent's forward in: its autocast dtype when on, else fp32."""
    if not getattr(agent, "amp_enabled", False):
        return "fp32"
    return name_of(agent.dtype)


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
def _meta_weights(filename: Any) -> Dict[str, torch.Tensor]:
    """The checkpoint's tensors as meta tensors of their shapes and dtypes: its header, not its bytes (read by
    checkpoint.Weights, the one reader of a checkpoint's weights)."""
    return Weights(str(filename)).meta()


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
            if ready is not None:  # the loader's say on the bundle's snapshot (`head_start.TokenizerSeed`) comes first
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
    _THIN.on, _THIN.weights = True, os.path.join(checkpoint, WEIGHTS_FILE)
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


__all__ = ["AgentWithModel", "Backend", "BackendUnavailable", "accelerated", "bucket_rows", "bucket_tokens",
           "build_eager_module", "context_len", "eager_agent", "embedding_rows", "embedding_rows_short",
           "guard_laya_switches", "head_attention_classes", "install_backend", "is_thin", "pad_batch", "pad_id",
           "serving_dtype", "serving_paused", "set_model", "thin_agent", "vocab"]
