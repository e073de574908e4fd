"""The dtype vocabulary, in one table: laya-aot's three names and what each one stands for.

The manifest, the config, the precision policy, the model and the TileLang catalogue all speak these
names (`fp32`, `bf16`, `fp16`); torch's dtypes and TileLang's strings are looked up here.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

# name -> its long name: torch's attribute (`torch.bfloat16`) and TileLang's dtype string
LONG: Dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
NAMES = tuple(LONG)
# other spellings callers hand in (torch dtypes printed, laya's LAYA_*_AMP values, "half")
_SPELLINGS: Dict[str, str] = {**{n: n for n in NAMES}, **{v: k for k, v in LONG.items()},
                              **{"torch." + v: k for k, v in LONG.items()}, "half": "fp16"}


def canonical(dtype: Any) -> Optional[str]:
    """The name for a spelling (`bfloat16`, `torch.bfloat16`, a torch dtype, `half`), None when unknown."""
    return _SPELLINGS.get(str(dtype).strip().lower())


def torch_dtype(name: str) -> Any:
    """The torch dtype of a name; a ValueError lists the names."""
    import torch

    if name not in LONG:
        raise ValueError("unknown dtype %r; use one of %s" % (name, ", ".join(NAMES)))
    return getattr(torch, LONG[name])


def name_of(dtype: Any, default: str = "fp32") -> str:
    """The name of a torch dtype (`default` for one outside the vocabulary)."""
    return canonical(dtype) or default


__all__ = ["LONG", "NAMES", "canonical", "name_of", "torch_dtype"]
