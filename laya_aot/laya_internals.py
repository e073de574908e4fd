"""Everything laya-aot uses of laya beyond `laya.load` and the Agent's public methods: one module to
re-check on a laya upgrade.

laya (0.4.15) has no public way to install a custom forward: `Agent.set_backend` takes backend names
only. So a bundle's backend is installed the way `set_backend` does it itself, under the agent's
reader/writer lock (`_gate`), replacing `_backend` and clearing `_fast`. `check()` lists every name
this module and `laya_aot.kernels` rely on; `tests/test_laya_internals.py` fails naming the first one a
new laya renamed.
"""
from __future__ import annotations

import importlib
from typing import Any, List, Tuple

import torch
from laya.backends.base import Backend, BackendUnavailable, bucket_rows, bucket_tokens, pad_batch

# (module, attribute path) pairs laya-aot needs; instance attributes are checked on an agent
MODULE_NAMES: Tuple[Tuple[str, str], ...] = (
    ("laya", "load"),
    ("laya.agent", "Agent.deaccelerate"),
    ("laya.backends.base", "Backend.install"),
    ("laya.backends.base", "Backend.stock_forward"),
    ("laya.backends.base", "BackendUnavailable"),
    ("laya.backends.base", "pad_batch"),
    ("laya.backends.base", "bucket_rows"),
    ("laya.backends.base", "bucket_tokens"),
    ("laya.common", "build_model"),
    ("laya.fast", "FastLaya"),           # laya_aot.kernels drives laya's fast path with precompiled kernels
    ("laya.tl_kernels", "gemm_kernel"),  # and hooks its kernel factories (kernels.catalogue.FACTORIES)
)
AGENT_NAMES: Tuple[str, ...] = ("_gate", "_backend", "_fast", "tok", "model", "device", "dtype", "amp_enabled")


def check(agent: Any = None) -> List[str]:
    """The names laya-aot needs that this laya lacks (empty when all are there)."""
    missing = []
    for module, path in MODULE_NAMES:
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
    """Make `backend` the agent's forward, as laya's own `set_backend` swaps backends: under its write lock."""
    with agent._gate.write_lock():
        agent.deaccelerate()
        backend.install()
        agent._backend = backend
        agent._fast = None


def pad_id(agent: Any) -> int:
    return int(agent.tok.pad_token_id or 0)


def vocab(agent: Any) -> int:
    """Token ids that are safe to feed: the encoder's embedding rows that the tokenizer can produce."""
    return min(int(agent.model.encoder.config.vocab_size), len(agent.tok))


def parallel_options(agent: Any) -> bool:
    return bool(getattr(agent, "parallel_options", False))


def serving_dtype(agent: Any) -> str:
    """The precision laya runs this agent's forward in: its autocast dtype when on, else fp32."""
    if not getattr(agent, "amp_enabled", False):
        return "fp32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(agent.dtype, "fp32")


__all__ = ["Backend", "BackendUnavailable", "bucket_rows", "bucket_tokens", "check",
           "install_backend", "pad_batch", "pad_id", "parallel_options", "serving_dtype", "vocab"]
