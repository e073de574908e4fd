"""Finding a Laya checkpoint on disk and fingerprinting it.

A bundle is only right for the weights it was built from: the fingerprint (sha256 of the files that
decide the model's answers) is stored in the manifest and checked again by the runtime. Hashing a
1.6 GB safetensors file costs about a second, so per-file digests are cached (`files.cached_sha256`), and the
weights are also fingerprinted in pieces that threads hash at once (`files.sha256_parts`), which the runtime checks.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from .errors import LayaAotError
from .files import PART_BYTES, cached_sha256, cached_sha256_parts
from .manifest import MANIFEST

log = logging.getLogger(__name__)

AGENT_CONFIG = "rl_agent_config.json"  # laya's agent settings (max_len, amp_dtype, head_layers, act_costs, ...)
ENCODER_CONFIG = "encoder/config.json"
WEIGHTS_FILE = "model.safetensors"  # the checkpoint's tensors, read through `Weights` only
FINGERPRINT_FILES = (WEIGHTS_FILE, AGENT_CONFIG, ENCODER_CONFIG)
TOKENIZER_DIR = "tokenizer"
# a file this large (the weights) is fingerprinted in pieces too (`fingerprint`), and is not one of the "small
# files" a start checks first (`differing_small_files`)
LARGE_FILE_BYTES = 64 << 20


class CheckpointError(LayaAotError, RuntimeError):
    """The checkpoint cannot be found or is not a Laya checkpoint."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """`laya_aot.load`'s checkpoint is not a directory here (still a FileNotFoundError, as it always was)."""


def _fingerprinted(ckpt: Path) -> Dict[str, Path]:
    """The files that decide the model's answers, by their path inside the checkpoint."""
    files = {rel: ckpt / rel for rel in FINGERPRINT_FILES if (ckpt / rel).exists()}
    tok = ckpt / TOKENIZER_DIR
    if tok.is_dir():
        files.update((p.relative_to(ckpt).as_posix(), p) for p in sorted(x for x in tok.rglob("*") if x.is_file()))
    return files


def fingerprint(ckpt: str | os.PathLike) -> Dict[str, Any]:
    """Digests of the files that decide the model's answers, and one combined digest; for every file of
    LARGE_FILE_BYTES or more (the weights) also its `files.sha256_parts`, which `mismatch` checks instead of
    its sha256: threads hash its pieces at once, so a start on a machine that never saw it waits less."""
    files: Dict[str, str] = {}
    parts: Dict[str, str] = {}
    for rel, p in _fingerprinted(Path(ckpt)).items():
        files[rel] = cached_sha256(p)
        if p.stat().st_size >= LARGE_FILE_BYTES:
            parts[rel] = cached_sha256_parts(p)
    return {"sha256": combined_digest(files), "files": files, "parts": parts, "part_bytes": PART_BYTES if parts else 0}


def combined_digest(files: Mapping[str, str]) -> str:
    """The checkpoint's one digest: its files' names and sha256s (what bundles, verdicts and packs are keyed by)."""
    return hashlib.sha256("".join("%s=%s\n" % kv for kv in sorted(files.items())).encode()).hexdigest()


def mismatch(built: Any, ckpt: str | os.PathLike) -> Optional[str]:
    """Why a bundle was not built from checkpoint `ckpt` (None: it was), the one comparison of fingerprints.

    `built` is the bundle's manifest (`manifest.Bundle`) or the fingerprint it records
    (`manifest.Fingerprint`). A file the fingerprint records `parts` for is checked by that digest (threads at
    once), every other by its sha256; the reason names both fingerprints and the files that differ; the caller
    adds what to do about it."""
    recorded = built.checkpoint.fingerprint if hasattr(built, "checkpoint") else built
    here = _fingerprinted(Path(ckpt))
    size = getattr(recorded, "part_bytes", 0)
    parts = (getattr(recorded, "parts", None) or {}) if size > 0 else {}
    # the record must hold together (its combined digest is its files' sha256s: what verdicts and packs are keyed
    # by), then every file must be the recorded one
    if combined_digest(recorded.files) == recorded.sha256 and set(here) == set(recorded.files) and all(
            (cached_sha256_parts(p, size, parts[rel]) == parts[rel]) if rel in parts
            else (cached_sha256(p, recorded.files[rel]) == recorded.files[rel])
            for rel, p in here.items()):
        return None
    digests = {rel: cached_sha256(p, recorded.files.get(rel)) for rel, p in here.items()}
    differ = sorted(k for k in set(recorded.files) | set(digests) if recorded.files.get(k) != digests.get(k))
    if not differ:  # every sha256 matches the record; a recorded parts digest did not, or the record's own digest
        differ = (sorted(rel for rel in parts
                         if rel in here and cached_sha256_parts(here[rel], size, parts[rel]) != parts[rel])
                  or ["the recorded combined digest, which is not its files'"])
    return ("it was built from another checkpoint than %s (fingerprint %s..., this one %s...; differing: %s)"
            % (ckpt, recorded.sha256[:12], combined_digest(digests)[:12], ", ".join(differ[:5]) or "?"))


def differing_small_files(ckpt: str | os.PathLike, recorded: Dict[str, str], limit_bytes: Optional[int] = None
                          ) -> List[str]:
    """The fingerprinted files under `limit_bytes` (LARGE_FILE_BYTES: configs, tokenizer) whose digest is not the one
    `recorded` in a manifest (absent or unreadable ones included), by their path in the checkpoint: a check of
    milliseconds, made before any heavy import (`session.LoadSession.open`), that tells a checkpoint of another
    architecture or tokenizer apart before the weights' digest (seconds for a large model never seen here) is known.
    """
    ckpt = Path(ckpt)
    limit_bytes = LARGE_FILE_BYTES if limit_bytes is None else limit_bytes
    differ = []
    for rel, digest in recorded.items():
        p = ckpt / rel
        try:
            if p.stat().st_size < limit_bytes and cached_sha256(p, digest) != digest:
                differ.append(rel)
        except OSError:
            differ.append(rel)
    return sorted(differ)


# safetensors' dtype names -> torch's attribute names (what a checkpoint laya saves can hold)
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
# the most bytes of the file on the device at once beyond the converted tensors (`Weights.load_to`)
LOAD_CHUNK_BYTES = 256 << 20


class Weights(Mapping):
    """The checkpoint's tensors by name, read from model.safetensors when asked for (memory-mapped, one at a
    time): what an artifact's constants are made from without building laya's module first, so each weight
    goes from the file to the device once, converted there."""

    def __init__(self, ckpt: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(ckpt) if Path(ckpt).is_file() else Path(ckpt) / WEIGHTS_FILE  # a directory, or the file
        self._file = safe_open(str(self.path), framework="pt")
        self._keys = frozenset(self._file.keys())

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self._file.get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def _header(self) -> Tuple[Dict[str, Any], int]:
        """The safetensors header (name -> dtype, shape, offsets) and where the tensors' bytes begin."""
        with open(self.path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            return json.loads(f.read(n).decode("utf-8")), 8 + n

    def shape(self, key: str) -> Tuple[int, ...]:
        """A tensor's shape, from the file's header (no bytes read)."""
        if key not in self._keys:
            raise KeyError(key)
        return tuple(self._file.get_slice(key).get_shape())

    def meta(self) -> Dict[str, Any]:
        """Every tensor as a meta tensor of its stored shape and dtype: the file's header, not its bytes (a thin
        agent's module shell, laya_internals)."""
        import torch

        header, _ = self._header()
        return {key: torch.empty(tuple(t["shape"]), dtype=getattr(torch, _ST_DTYPES.get(t.get("dtype"), ""),
                                                                     torch.float32), device="meta")
                for key, t in header.items() if key in self._keys and isinstance(t, dict)}

    def allocate(self, targets: Mapping[str, Any], device: Any) -> Dict[str, Any]:
        """Unwritten tensors shaped as the file stores the ones named in `targets` (name -> torch dtype), in that
        dtype on `device`: what `load_to(..., into=)` fills."""
        import torch

        header, _ = self._header()
        out = {}
        for key, dtype in targets.items():
            t = header.get(key)
            if key not in self._keys or not isinstance(t, dict):
                raise KeyError(key)
            out[key] = torch.empty(tuple(t["shape"]), dtype=dtype, device=device)
        return out

    def load_to(self, targets: Mapping[str, Any], device: Any, into: Optional[Mapping[str, Any]] = None
                ) -> Dict[str, Any]:
        """The tensors named in `targets` (name -> torch dtype) on `device`, each converted there and owning its
        storage (written into `into[name]` where given: `allocate`'s tensors). The file's bytes cross to the
        device in a few large copies of consecutive tensors (at most LOAD_CHUNK_BYTES each) instead of one small
        copy per tensor; a tensor whose bytes cannot be viewed in place (unaligned, an unknown dtype) is read on
        its own."""
        import mmap

        import torch

        header, base = self._header()
        into = into or {}
        spans, out = [], {}
        for key, dtype in targets.items():
            t = header.get(key)
            if key not in self._keys or not isinstance(t, dict):
                raise KeyError(key)
            stored = getattr(torch, _ST_DTYPES.get(t.get("dtype"), ""), None)
            begin, end = t["data_offsets"]
            if isinstance(stored, torch.dtype) and begin % stored.itemsize == 0 and base % stored.itemsize == 0:
                spans.append((begin, end, key, stored, tuple(t["shape"]), dtype))
            elif key in into:
                out[key] = into[key].copy_(self[key])
            else:
                out[key] = self[key].to(device=device).to(dtype=dtype).contiguous()
        spans.sort()
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            data = memoryview(mm)
            try:
                i = 0
                while i < len(spans):
                    j, start = i + 1, spans[i][0]
                    while j < len(spans) and spans[j][1] - start <= LOAD_CHUNK_BYTES:
                        j += 1
                    _convert_chunk(data[base + start:base + spans[j - 1][1]], start, spans[i:j], device, out, into)
                    i = j
            finally:
                data.release()
        return out


def _convert_chunk(raw: memoryview, start: int, spans: list, device: Any, out: Dict[str, Any],
                   into: Mapping[str, Any]) -> None:
    """Copy one run of the file's bytes to `device`, then each tensor in it, converted, into `out` (into the tensor
    `into` has for it, if any; copies either way: none of them keeps the run, or the file's mapping, alive).
    A failure (the device out of memory, a tensor of another shape in `into`) drops this frame's views of the
    mapping before it propagates: its traceback keeps the frame, and a view alive there made closing the mapping
    raise BufferError ("cannot close exported pointers exist") in place of the error itself."""
    import torch

    chunk = view = None
    try:
        with warnings.catch_warnings():  # read-only bytes: only ever copied from, never written
            warnings.simplefilter("ignore", UserWarning)
            chunk = torch.frombuffer(raw, dtype=torch.uint8).to(device=device)
        for begin, end, key, stored, shape, dtype in spans:
            view = chunk[begin - start:end - start].view(stored).view(shape)
            out[key] = into[key].copy_(view) if key in into else view.to(dtype=dtype, copy=True).contiguous()
    finally:
        del chunk, view
        raw.release()


_LAYOUT = "a Laya checkpoint directory (rl_agent_config.json, model.safetensors, tokenizer/, encoder/)"


# a Hugging Face Hub repo id as laya's Router names a checkpoint: owner/name, each part of word characters, '.' and
# '-', neither starting nor ending with '.' or '-' (the Hub's own rule; it also refuses '--' and '..')
_HUB_ID = re.compile(r"\w(?:[\w.-]*\w)?/\w(?:[\w.-]*\w)?")
_HUB_ID_MAX = 96


def is_hub_id(value: str) -> bool:
    """Whether `value` is a Hub repo id a Laya checkpoint goes by (`owner/name`: exactly one slash, no leading dot).
    Anything else (absolute, ~, ./, ../, two slashes, or a bare name: the Hub's legacy ids, which no Laya checkpoint
    uses) that is not on disk is a mistyped directory, never looked up in the Hub cache."""
    return (len(value) <= _HUB_ID_MAX and _HUB_ID.fullmatch(value) is not None
            and "--" not in value and ".." not in value)


def not_found(value: Any, fix: str) -> CheckpointNotFound:
    """The one message for a checkpoint directory that is not there: the value as given, and what to change."""
    return CheckpointNotFound("checkpoint directory %s does not exist; %s" % (value, fix))


def _fix(setting: Optional[str]) -> str:
    """What to change, in the caller's terms: the setting the value came from, or the build's checkpoint.path."""
    return "fix %s" % setting if setting else "pass checkpoint.path=DIR with %s" % _LAYOUT


def check_layout(ckpt: Path, setting: Optional[str] = None) -> None:
    """Refuse a path that is not a Laya checkpoint, naming what is wrong: absent, a file, missing files, or
    weights whose safetensors header does not describe the file (truncated or damaged). `setting`: what the path
    came from, named as the fix (None: the build's checkpoint.path)."""
    if not ckpt.exists():
        raise not_found(ckpt, _fix(setting))
    if not ckpt.is_dir():
        raise CheckpointError("checkpoint %s is a file, not a directory; %s (the directory that holds the file, if "
                              "it is one of them)" % (ckpt, _fix(setting)))
    missing = [n for n in (AGENT_CONFIG, "model.safetensors", TOKENIZER_DIR, ENCODER_CONFIG)
               if not (ckpt / n).exists()]
    if missing:
        raise CheckpointError("%s is not a Laya checkpoint: missing %s. A checkpoint holds rl_agent_config.json, "
                              "model.safetensors, tokenizer/ and encoder/ (laya's save_checkpoint writes them)"
                              % (ckpt, ", ".join(missing)))
    why = weights_problem(ckpt / "model.safetensors")
    if why:
        raise CheckpointError("%s/model.safetensors is damaged (%s); copy the checkpoint again, or re-create it"
                              % (ckpt, why))


_MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit


def weights_problem(path: Path) -> Optional[str]:
    """Why a safetensors file is not whole (None: its header parses and its tensors end where the file does):
    reads the header only, so it tells a truncated or damaged file from other weights in milliseconds."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return "%d bytes, shorter than a safetensors header" % size
            n = int.from_bytes(head, "little")
            if n > min(_MAX_SAFETENSORS_HEADER, size - 8):
                return "its header claims %d bytes, the file has %d" % (n, size)
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as e:
        return "unreadable: %s" % (e.strerror or e)
    except (ValueError, RecursionError):
        return "its header is not valid JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)):
            return "tensor %s has no data offsets" % str(name)[:80]
        end = max(end, offsets[1])
    if 8 + n + end != size:
        return "its tensors need %d bytes, the file has %d (truncated or padded)" % (8 + n + end, size)
    return None


def read_config(ckpt: str | os.PathLike, name: str = AGENT_CONFIG) -> Dict[str, Any]:
    """A checkpoint's JSON config: laya's rl_agent_config.json, or `ENCODER_CONFIG`; the one reader of them."""
    with open(Path(ckpt) / name, encoding="utf-8") as f:
        return json.load(f)


def eager_only(ckpt: str | os.PathLike) -> Optional[str]:
    """Why no artifact can serve this checkpoint, whatever bundle is given (None: one can): laya's
    option_layout='parallel' masks, which only laya's eager forward computes (the build refuses it too)."""
    try:
        layout = read_config(ckpt).get("option_layout", "sequential")
    except (OSError, ValueError, AttributeError):  # laya's own load says what is wrong with the file
        return None
    if layout == "parallel":
        return "this checkpoint uses option_layout='parallel', which only laya's eager forward runs"
    return None


def resolve(cfg: Any) -> Path:
    """The checkpoint directory a `CheckpointConfig` names by `path` or `hub_id` (the demo's: `demo.resolve`)."""
    if cfg.path:
        ckpt = Path(os.path.expanduser(str(cfg.path)))
        check_layout(ckpt)
        return ckpt
    if cfg.hub_id:
        if not is_hub_id(str(cfg.hub_id)):  # a path given as a repo id: the Hub's own refusal would advise a download
            raise CheckpointError("checkpoint.hub_id=%s is not a Hugging Face repo id (owner/name); for a checkpoint "
                                  "directory pass checkpoint.path=%s" % (cfg.hub_id, cfg.hub_id))
        return from_hf_cache(cfg.hub_id, cfg.subfolder)
    raise CheckpointError("no checkpoint given: set checkpoint.path=DIR, pick a shipped one (checkpoint=laya), "
                          "or use the demo (checkpoint=demo)")


def locate(checkpoint: str, setting: str = "laya_aot.load's checkpoint argument") -> Path:
    """The directory `laya_aot.load` was handed: a local path, or a hub id already in the local HF cache.
    `setting`: where the value came from, named as the fix."""
    if os.path.isdir(checkpoint):
        if not os.path.lexists(os.path.join(checkpoint, AGENT_CONFIG)):  # what laya's load asks first
            fix = ("it is a laya-aot bundle: pass it as bundle= and the checkpoint it was built from as checkpoint"
                   if os.path.lexists(os.path.join(checkpoint, MANIFEST)) else
                   "pass the Laya checkpoint directory the bundle was built from (laya's save_checkpoint writes it)")
            raise CheckpointNotFound("%s is not a Laya checkpoint: it has no %s; %s" % (checkpoint, AGENT_CONFIG, fix))
        return Path(checkpoint)
    if os.path.lexists(checkpoint):
        raise CheckpointNotFound("checkpoint %s is a file, not a directory; pass the Laya checkpoint directory the "
                                "bundle was built from" % checkpoint)
    return find(checkpoint, None, setting)


def find(source: str, subfolder: Optional[str], setting: str) -> Path:
    """The checkpoint directory a value names (`laya_aot.load`'s argument, a LAYA_EXTRA_MODELS entry): a local
    directory, or a Hub repo id (`is_hub_id`) already in the local HF cache. Anything else that is not there is a
    directory that does not exist, named with `setting` as the fix: read as a repo id, a mistyped path was refused
    by the Hub's id check and answered with advice to download it."""
    local = Path(os.path.expanduser(source))
    if local.is_dir():
        ckpt = local / subfolder if subfolder else local
        check_layout(ckpt, setting)
        return ckpt
    if local.exists():
        check_layout(local, setting)  # a file: named as one
    if not is_hub_id(source):
        raise not_found(source, _fix(setting))
    return from_hf_cache(source, subfolder, setting)


def from_hf_cache(hub_id: str, subfolder: Optional[str], setting: Optional[str] = None) -> Path:
    """A shipped checkpoint from the local Hugging Face cache; nothing is downloaded. `setting`: where the repo id
    came from (None: the build's checkpoint.hub_id, whose alternative is checkpoint.path)."""
    try:
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(hub_id, local_files_only=True))
    except Exception as e:
        where, instead = (("neither a directory here nor", "set %s to the checkpoint directory" % setting)
                          if setting else ("not", "pass checkpoint.path=DIR pointing at the checkpoint directory"))
        raise CheckpointError(
            "checkpoint %s%s is %s in the local Hugging Face cache, and laya-aot never downloads weights "
            "(%s: %s). On a machine with network run `huggingface-cli download %s` once, or %s"
            % (hub_id, "/" + subfolder if subfolder else "", where, type(e).__name__, e, hub_id, instead)) from e
    ckpt = root / subfolder if subfolder else root
    check_layout(ckpt, setting)
    return ckpt


def path_name(path: str | os.PathLike) -> str:
    """The name a checkpoint given as a directory goes by (its bundle's default output, artifacts/NAME): the
    directory's own name."""
    return Path(os.path.expanduser(str(path))).resolve().name


def describe(ckpt: Path, cfg: Any) -> Dict[str, Any]:
    """Name, context length and dtype: from the config when given, else from the checkpoint."""
    rl = read_config(ckpt)
    # `checkpoint.path=DIR` over the default demo config names the bundle after DIR, not "demo" (the command line
    # says so itself: `usage.implied_overrides`)
    name = path_name(ckpt) if (cfg.path and cfg.demo_shape) or not cfg.name else cfg.name
    return {
        "name": name,
        "path": str(ckpt.resolve()),
        "max_len": int(cfg.max_len or rl.get("max_len", 512)),
        # as the checkpoint states it (absent: None); precision.py turns it into laya's serving dtype
        "amp_dtype": rl.get("amp_dtype"),
        "head_layers": rl.get("head_layers"),
        "n_actions": len(rl.get("act_costs", {})) + 1,
        "option_layout": rl.get("option_layout", "sequential"),
    }
