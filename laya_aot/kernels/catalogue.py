"""The TileLang kernel catalogue of laya's fast path, derived by rule from an encoder config.

`laya.fast.FastLaya` requests fixed kernels in its constructor and, per request shape, RoPE and
flash attention (dynamic up to `DYNAMIC_MAX_L` tokens, static per bucket beyond), so the set is finite
once rows and tokens are bounded. This module writes that set down without TileLang or a model, so a
build machine knows what to compile from the config alone (`tests/kernels/test_kernels.py` proves it equals
what FastLaya requests). Calls are normalised as TileLang keys its JIT cache (bound, defaults applied).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..numerics.dtypes import LONG, canonical

FACTORIES = ("gemm_kernel", "gemm_geglu_kernel", "add_ln_kernel", "rope_kernel", "attn_kernel")
HEAD_EPS = 1e-5          # nn.TransformerEncoderLayer's LayerNorm eps, hard-coded in FastLaya too


# ------------------------------------------------------------------------------------ signatures
@dataclass(frozen=True)
class _Param:
    name: str
    default: Any          # _REQUIRED when the parameter has none
    kw_only: bool


_REQUIRED = object()


@functools.lru_cache(maxsize=1)
def factory_signatures() -> Dict[str, Tuple[_Param, ...]]:
    """Parameter lists of the laya.tl_kernels factories, read from the source with `ast`.

    Why not `inspect.signature`: importing laya.tl_kernels imports TileLang, which the catalogue
    should not need (it is pure bookkeeping). The defaults are literals, so `ast.literal_eval`
    reads them exactly; a test checks the result against the imported factories.
    """
    spec = importlib.util.find_spec("laya.tl_kernels")
    if spec is None or spec.origin is None:
        raise ImportError("laya.tl_kernels not found: is laya>=0.4.15 installed?")
    tree = ast.parse(open(spec.origin, encoding="utf-8").read(), filename=spec.origin)
    out: Dict[str, Tuple[_Param, ...]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FACTORIES:
            a = node.args
            pos = a.posonlyargs + a.args
            defaults = [_REQUIRED] * (len(pos) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
            params = [_Param(p.arg, d, False) for p, d in zip(pos, defaults)]
            params += [_Param(p.arg, _REQUIRED if d is None else ast.literal_eval(d), True)
                       for p, d in zip(a.kwonlyargs, a.kw_defaults)]
            out[node.name] = tuple(params)
    missing = set(FACTORIES) - set(out)
    if missing:
        raise ImportError("laya.tl_kernels lacks the factories %s; this laya is not supported" % sorted(missing))
    return out


def normalise_call(factory: str, args: Sequence[Any] = (), kwargs: Optional[Mapping[str, Any]] = None
                   ) -> Tuple[Tuple[str, Any], ...]:
    """Bind a factory call to its signature, defaults applied, in signature order."""
    params = factory_signatures()[factory]
    kwargs = dict(kwargs or {})
    positional = [p for p in params if not p.kw_only]
    if len(args) > len(positional):
        raise TypeError("%s takes %d positional arguments, got %d" % (factory, len(positional), len(args)))
    bound: Dict[str, Any] = {p.name: v for p, v in zip(positional, args)}
    for name, value in kwargs.items():
        if name in bound:
            raise TypeError("%s got multiple values for %r" % (factory, name))
        if name not in {p.name for p in params}:
            raise TypeError("%s got an unexpected argument %r" % (factory, name))
        bound[name] = value
    out = []
    for p in params:
        if p.name not in bound and p.default is _REQUIRED:
            raise TypeError("%s is missing the argument %r" % (factory, p.name))
        out.append((p.name, bound.get(p.name, p.default)))
    return tuple(out)


# ------------------------------------------------------------------------------------ the spec
def _fmt(value: Any) -> str:
    if value is None:
        return "dyn"
    if isinstance(value, bool):
        return "1" if value else "0"
    return re.sub(r"[^A-Za-z0-9.+-]", "_", str(value))


@dataclass(frozen=True)
class KernelSpec:
    """One `laya.tl_kernels` factory call: the unit that is compiled, shipped and loaded.

    `args` is the full binding (signature order, defaults applied), so equal specs are exactly
    the calls TileLang would serve from one JIT-cache entry.
    """

    factory: str
    args: Tuple[Tuple[str, Any], ...]

    @classmethod
    def of(cls, factory: str, *args: Any, **kwargs: Any) -> "KernelSpec":
        """The spec of `laya.tl_kernels.<factory>(*args, **kwargs)`."""
        return cls(factory, normalise_call(factory, args, kwargs))

    @property
    def kwargs(self) -> Dict[str, Any]:
        return dict(self.args)

    @functools.cached_property
    def digest(self) -> str:
        """Hash of the full binding: changes when laya changes any default (tile sizes, stages)."""
        blob = json.dumps([self.factory, [list(a) for a in self.args]], sort_keys=False, default=repr)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    @functools.cached_property
    def key(self) -> str:
        """Stable, file-name-safe name: required and non-default arguments, then the digest."""
        defaults = {p.name: p.default for p in factory_signatures()[self.factory]}
        parts = [self.factory]
        for name, value in self.args:
            if defaults[name] is _REQUIRED or value != defaults[name] or name == "dtype":
                parts.append("%s-%s" % (name, _fmt(value)))
        return ".".join(parts + [self.digest])

    def to_json(self) -> Dict[str, Any]:
        return {"factory": self.factory, "kwargs": self.kwargs}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "KernelSpec":
        return cls.of(d["factory"], **d["kwargs"])


# ------------------------------------------------------------------------------------ the rules
@dataclass(frozen=True)
class EncoderDims:
    """What the kernels depend on in an encoder config (mirrors FastLaya.__init__)."""

    hidden: int
    heads: int
    intermediate: int
    eps: float
    windows: Tuple[int, ...]      # attention window per distinct layer kind: 0 = global

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def head_heads(self) -> int:
        """The decision head's own head count (laya.common.DecisionModel: max(1, d // 64))."""
        return max(1, self.hidden // 64)

    @property
    def head_head_dim(self) -> int:
        return self.hidden // self.head_heads


def _as_config(encoder_config: Any):
    """A transformers config object, so derived fields (layer_types, sliding_window) follow HF."""
    if isinstance(encoder_config, Mapping):
        from transformers import AutoConfig

        d = dict(encoder_config)
        model_type = d.pop("model_type", "modernbert")
        return AutoConfig.for_model(model_type, **d)
    return encoder_config


def encoder_dims(encoder_config: Any) -> EncoderDims:
    cfg = _as_config(encoder_config)
    if getattr(cfg, "model_type", "modernbert") != "modernbert":
        raise ValueError("laya's TileLang kernels implement ModernBERT; got model_type %r" % cfg.model_type)
    win = getattr(cfg, "sliding_window", None) or cfg.local_attention // 2
    windows = sorted({win if t == "sliding_attention" else 0 for t in cfg.layer_types})
    return EncoderDims(cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg.norm_eps, tuple(windows))


def kernel_dtype(dtype: Any) -> str:
    """TileLang's dtype string for a 16-bit dtype in any spelling `dtypes.canonical` knows."""
    name = canonical(dtype)
    if name not in ("bf16", "fp16"):
        raise ValueError("the TileLang fast path runs bf16 or fp16, got %r" % (dtype,))
    return LONG[name]


def _padding_policy() -> Tuple[int, int]:
    from laya.backends import base

    return base.DYNAMIC_MAX_L, base.LONG_BUCKET


def row_buckets(max_rows: int) -> List[int]:
    """Every padded row count a request of 1..max_rows rows turns into (powers of two)."""
    from laya.backends.base import bucket_rows

    return sorted({bucket_rows(n) for n in range(1, max_rows + 1)})


def static_lengths(max_len: int) -> List[int]:
    """Padded token counts that get static attention kernels: those past DYNAMIC_MAX_L."""
    from laya.backends.base import bucket_tokens

    dyn_max, _ = _padding_policy()
    return sorted({bucket_tokens(n, max_len) for n in range(dyn_max + 1, max_len + 1)})


def fixed_specs(dims: EncoderDims, dtype: str) -> List[KernelSpec]:
    """The eleven kernels FastLaya's constructor asks for (shape-independent)."""
    D, F, kd = dims.hidden, dims.intermediate, kernel_dtype(dtype)
    return [
        KernelSpec.of("gemm_kernel", 3 * D, D, dtype=kd),
        KernelSpec.of("gemm_kernel", D, D, dtype=kd),
        KernelSpec.of("gemm_geglu_kernel", F, D, dtype=kd),
        KernelSpec.of("gemm_kernel", D, F, dtype=kd),
        KernelSpec.of("add_ln_kernel", D, residual=True, bias=False, eps=dims.eps, dtype=kd),
        KernelSpec.of("add_ln_kernel", D, residual=True, bias=True, eps=HEAD_EPS, dtype=kd),
        KernelSpec.of("add_ln_kernel", D, residual=False, bias=True, eps=HEAD_EPS, dtype=kd),
        KernelSpec.of("gemm_kernel", 3 * D, D, bias=True, dtype=kd),
        KernelSpec.of("gemm_kernel", D, D, bias=True, dtype=kd),
        KernelSpec.of("gemm_kernel", 4 * D, D, bias=True, act="relu", dtype=kd),
        KernelSpec.of("gemm_kernel", D, 4 * D, bias=True, dtype=kd),
    ]


def attention_specs(dims: EncoderDims, dtype: str, rows: Optional[int], tokens: Optional[int],
                    head_layers: int = 2) -> List[KernelSpec]:
    """Attention kernels one padded (rows, tokens) shape uses: encoder kinds, then the head.

    `rows`/`tokens` None means the dynamic kernel (what FastLaya uses up to DYNAMIC_MAX_L)."""
    kd = kernel_dtype(dtype)
    out = [KernelSpec.of("attn_kernel", rows, tokens, dims.heads, dims.head_dim, window=w, dtype=kd)
           for w in dims.windows]
    if head_layers > 0:
        out.append(KernelSpec.of("attn_kernel", rows, tokens, dims.head_heads, dims.head_head_dim, window=0, dtype=kd))
    return out


def shape_specs(dims: EncoderDims, dtype: str, n_rows: int, n_tokens: int, max_len: int,
                head_layers: int = 2) -> List[KernelSpec]:
    """Kernels a request of n_rows x n_tokens needs, padded exactly as FastLaya pads it."""
    from laya.backends.base import bucket_rows, bucket_tokens

    dyn_max, _ = _padding_policy()
    L = bucket_tokens(n_tokens, max_len)
    B = bucket_rows(n_rows)
    rope = KernelSpec.of("rope_kernel", dims.heads, dims.head_dim, dtype=kernel_dtype(dtype))
    if L <= dyn_max:
        return [rope] + attention_specs(dims, dtype, None, None, head_layers)
    return [rope] + attention_specs(dims, dtype, B, L, head_layers)


def _dedup(specs: Iterable[KernelSpec]) -> List[KernelSpec]:
    return list(dict.fromkeys(specs))


def catalogue(encoder_config: Any, dtype: str = "bf16", max_len: int = 512, max_rows: int = 64,
              head_layers: int = 2) -> List[KernelSpec]:
    """Every TileLang kernel laya's fast path can request for this checkpoint and export range.

    encoder_config: the encoder's HF config (dict from encoder/config.json, or the object).
    dtype: "bf16" or "fp16", the agent's autocast dtype (`amp_dtype` in rl_agent_config.json).
    max_len: the checkpoint's context (`max_len` in rl_agent_config.json; FastLaya's max_len).
    max_rows: the most rows (questions) one call may carry; rows are padded to powers of two,
        so the largest static attention bucket is the power of two at or above it.
    head_layers: decision-head layers (`head_layers` in rl_agent_config.json); 0 drops the
        head's attention. The head's width is the encoder's hidden size (DecisionModel), so
        its heads and head dim follow from the config.

    Order: fixed kernels, RoPE, dynamic attention, then static attention by (tokens, rows).
    Duplicates (e.g. the head's attention when it coincides with global encoder attention at
    head dim 64) appear once: TileLang serves them from one compiled kernel.
    """
    if max_rows < 1 or max_len < 1:
        raise ValueError("max_rows and max_len must be positive")
    dims = encoder_dims(encoder_config)
    specs = fixed_specs(dims, dtype)
    specs += shape_specs(dims, dtype, 1, 1, max_len, head_layers)
    for L in static_lengths(max_len):
        for B in row_buckets(max_rows):
            specs += attention_specs(dims, dtype, B, L, head_layers)
    return _dedup(specs)


__all__ = ["KernelSpec", "EncoderDims", "catalogue", "encoder_dims", "fixed_specs", "attention_specs",
           "shape_specs", "row_buckets", "static_lengths", "kernel_dtype", "normalise_call", "factory_signatures"]
