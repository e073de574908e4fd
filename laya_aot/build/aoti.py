"""Stage c: AOTInductor package for the target, with the weights kept out of the package.

`aot_inductor.package_constants_in_so=False` makes the package a few MB instead of the model's size,
so a bundle for N architectures does not carry N copies of the weights. `constants.json` beside the
package says where each constant comes from at load time: a tensor of the checkpoint's
model.safetensors (converted to the dtype it names) or, for the few tensors a checkpoint does not
hold (RoPE frequencies, lifted constants), `extra_constants.safetensors`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Iterable

import torch
from torch.export import ExportedProgram

from ..runtime.runners import AOTI_CONSTANTS, AOTI_EXTRA, AOTI_PACKAGE

log = logging.getLogger(__name__)

WRAPPER_PREFIX = "model."


def constants_spec(ep: ExportedProgram, checkpoint_keys: Iterable[str]) -> Dict[str, Any]:
    """For every constant of the program: its dtype and where the runtime finds its value."""
    keys = set(checkpoint_keys)
    spec: Dict[str, Dict[str, str]] = {}
    extra: Dict[str, torch.Tensor] = {}
    tensors = dict(ep.state_dict)
    tensors.update({k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)})
    for fqn, t in sorted(tensors.items()):
        key = fqn[len(WRAPPER_PREFIX):] if fqn.startswith(WRAPPER_PREFIX) else fqn
        dtype = str(t.dtype).replace("torch.", "")
        if key in keys:
            spec[fqn] = {"source": "model", "key": key, "dtype": dtype}
        else:
            spec[fqn] = {"source": "extra", "key": fqn, "dtype": dtype}
            extra[fqn] = t.detach().cpu().contiguous()
    return {"constants": spec, "extra": extra}


def package(ep: ExportedProgram, out_dir: Path, checkpoint_keys: Iterable[str]) -> Dict[str, Any]:
    """Compile `ep` into `out_dir/model.pt2` plus its constants map; returns facts for the manifest."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    spec = constants_spec(ep, checkpoint_keys)
    torch._inductor.aoti_compile_and_package(
        ep, package_path=str(out_dir / AOTI_PACKAGE),
        inductor_configs={"aot_inductor.package_constants_in_so": False})
    (out_dir / AOTI_CONSTANTS).write_text(json.dumps({"constants": spec["constants"]}, indent=1), encoding="utf-8")
    if spec["extra"]:
        save_file(spec["extra"], str(out_dir / AOTI_EXTRA))
    n_model = sum(1 for s in spec["constants"].values() if s["source"] == "model")
    return {"package_bytes": (out_dir / AOTI_PACKAGE).stat().st_size,
            "constants_from_checkpoint": n_model, "constants_in_bundle": len(spec["extra"])}
