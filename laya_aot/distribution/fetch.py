"""Turn a bundle address into a local bundle directory holding what this machine can use.

`resolve(spec)` (behind `laya_aot.load(..., bundle=spec)` and `laya-aot fetch SPEC`) accepts a bundle
directory; a pack `*.tar.zst` (unpacked once into the cache, keyed by its sha256); a directory of packs
(the pack of this checkpoint with the most artifacts usable here); or `hf://ORG/REPO[/PATH][@REVISION]`
(bundle.json first, then only the files of artifacts `usable.usable_here` accepts, through
`huggingface_hub`, pinned to the manifest's commit). Hub files are hard-linked (or copied) into a bundle
directory of their own, since the loader refuses links; artifacts not fetched are rejected with a reason.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .. import kinds, progress, staging
from ..bundle_format import MAX_MANIFEST_BYTES, check_files, parse_bundle, read_bundle
from ..files import cache_dir, cache_unwritable, cached_sha256, read_cache_bytes
from ..kinds.usable import usable_here
from ..manifest import MANIFEST, BundleError, FileRecord
from . import HF_SCHEME, PACK_SUFFIX

log = logging.getLogger(__name__)
UNPACK_WAIT_S = 300.0  # how long a load waits for another process unpacking the same pack into the cache



@dataclass
class Fetched:
    """What `fetch` made available: the local bundle, the artifacts fetched, and why the others were not."""

    path: Path
    source: str
    fetched: List[str] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    downloaded: int = 0  # files that were not in the cache before (hf:// only)


def parse_hf(spec: str) -> Tuple[str, str, Optional[str]]:
    """`hf://ORG/REPO[/PATH][@REVISION]` -> (repo id, path in the repo, revision or None)."""
    rest = spec[len(HF_SCHEME):]
    revision = None
    if "@" in rest:
        rest, _, revision = rest.rpartition("@")
    parts = [p for p in rest.strip("/").split("/") if p]
    if len(parts) < 2 or not revision and revision is not None or any(p in (".", "..") for p in parts):
        raise BundleError("%r is not a Hugging Face bundle address; write hf://ORG/REPO[/PATH][@REVISION]" % spec)
    return "/".join(parts[:2]), "/".join(parts[2:]), revision


def resolve(spec: str | os.PathLike, device: Optional[str] = None, checkpoint: Optional[Path] = None) -> Path:
    """A local bundle directory for `spec` (see the module's docstring); a bundle directory is returned as is,
    and anything that is none of the forms above too, for the loader to explain."""
    if isinstance(spec, (str, os.PathLike)) and str(spec).startswith(HF_SCHEME):
        return fetch(str(spec), device=device).path
    p = Path(spec)
    if packed(p):
        return fetch(p, device=device, checkpoint=checkpoint).path
    if _is_file(p):
        raise BundleError(_not_a_pack(p))
    return p  # a bundle directory, or something the manifest reader explains (absent, unreadable, ...)


def _not_a_pack(p: Path) -> str:
    return ("%s is a file, not a bundle directory or a pack: a pack's name ends in %s (`laya-aot pack` writes one); "
            "rename it so if it is one, else pass the bundle's directory" % (p, PACK_SUFFIX))


def packed(p: Path) -> bool:
    """Whether `p` is a pack or a directory of packs: what `resolve` unpacks before a load (`laya-aot serve` asks
    too, for LAYA_AOT_BUNDLES)."""
    return _is_file(p) and p.name.endswith(PACK_SUFFIX) or _is_dir(p) and _packs_only(p)


def resolve_for_load(spec, device: Optional[str], checkpoint: Path) -> Tuple[object, Optional[str]]:
    """`resolve` for the loader: (local bundle directory, None), or (spec, why it could not be fetched), so a
    bundle that cannot be fetched is one reason among the loader's (eager fallback, or strict's error)."""
    if spec is None or not str(spec):
        return spec, None
    try:
        return resolve(spec, device=device, checkpoint=checkpoint), None
    except BundleError as e:
        return spec, str(e)
    except OSError as e:  # a pack or cache the service's user may not read or write: one reason, never a raise
        return spec, ("cannot use %s (%s: %s); check its permissions and the laya-aot cache's (LAYA_AOT_CACHE_DIR)"
                      % (spec, type(e).__name__, e))
    except Exception as e:  # noqa: BLE001 - nothing on disk may make load(strict=False) raise; a bug here is reported
        log.warning("laya-aot: internal error while fetching %s", spec, exc_info=True)
        return spec, "internal error in laya-aot while fetching it (%s: %s); please report this" % (
            type(e).__name__, str(e)[:300])


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except OSError:
        return False


def _is_dir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


def _packs_only(d: Path) -> bool:
    """A directory with no bundle.json and some packs; False when it cannot be read (the reader says why)."""
    try:
        return not os.path.lexists(d / MANIFEST) and any(d.glob("*" + PACK_SUFFIX))
    except OSError:
        return False


def fetch(spec: str | os.PathLike, device: Optional[str] = None, out: Optional[Path] = None,
          checkpoint: Optional[Path] = None, overwrite: bool = False) -> Fetched:
    """Make the bundle at `spec` available locally (in the laya-aot cache, or in `out`, which `overwrite`
    lets replace a directory laya-aot did not write)."""
    if str(spec).startswith(HF_SCHEME):
        return _from_hub(str(spec), device, out, overwrite)
    p = Path(spec)
    if p.is_dir() and (p / MANIFEST).exists():
        if out is not None:
            raise BundleError("%s is already a local bundle; copy it, or pack it (`laya-aot pack`) to move it" % p)
        ok, skipped = usable_here(read_bundle(p, kinds.BY_NAME), device)
        return Fetched(p, str(p), [a.name for a in ok], skipped)
    if p.is_dir() and _packs_only(p):
        p = _choose_pack(p, device, checkpoint)
    if p.is_file() and p.name.endswith(PACK_SUFFIX):
        return _from_pack(p, device, out, overwrite)
    if _is_file(p):
        raise BundleError(_not_a_pack(p))
    if not os.path.lexists(p):
        raise BundleError("%s does not exist; pass a bundle directory, a pack (*%s), a directory of packs or an "
                          "hf:// address" % (spec, PACK_SUFFIX))
    raise BundleError("%s is neither a bundle directory, a pack (*%s), a directory of packs nor an hf:// address"
                      % (spec, PACK_SUFFIX))


def _from_pack(file: Path, device: Optional[str], out: Optional[Path], overwrite: bool = False) -> Fetched:
    from .pack import read_pack_manifest_bytes, unpack

    raw, manifest = read_pack_manifest_bytes(file)
    ok, skipped = usable_here(manifest, device)
    if out is not None:
        unpack(file, out, overwrite)
        target = out
    else:  # the cache's unpacking of this pack, used only while it is that: unpacked again otherwise
        target = cache_dir() / "packs" / cached_sha256(file)[:32]
        why = _unpacked_problem(target, raw, ok)
        if why is not None:
            if os.path.lexists(target):
                log.info("laya-aot: the unpacked copy of %s in the cache is not used (%s); unpacking it again",
                         file, why)
            try:
                _unpack_shared(file, target, raw, ok)
            except staging.OutputUnwritable as e:
                target = _unpack_private(file, target, raw, ok, e.cause)
    files = [r for a in manifest.artifacts if a.built for r in a.files.values()]
    return Fetched(target, str(file), [a.name for a in ok], skipped, len(files), sum(r.size for r in files))


def _unpack_shared(file: Path, target: Path, raw: bytes, usable: List[Any]) -> None:
    """`file` unpacked into the cache's `target` (keyed by the pack's sha256), where another process may be unpacking
    it at the same moment (the workers of one server, starting together): while that one holds the output, wait for
    it (at most UNPACK_WAIT_S) and take what it unpacked; a busy output made every other worker serve eager."""
    from .pack import unpack

    deadline = time.monotonic() + UNPACK_WAIT_S
    while True:
        try:
            unpack(file, target, cache=True)
            return
        except staging.OutputBusy:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)
        if _unpacked_problem(target, raw, usable) is None:  # the other process's unpacking, whole and checked
            return


# packs unpacked outside the cache by this process (the cache could not take them), by the cache entry each stands for
_PRIVATE: Dict[Path, Path] = {}


def _unpack_private(file: Path, entry: Path, raw: bytes, usable: List[Any], cause: OSError) -> Path:
    """`file` unpacked by the same `unpack` into a directory of this process's own (`staging.private_dir`, removed
    at exit) where the cache's `entry` cannot be written (`cause`): a read-only cache served laya's eager forward.
    Its files are hashed as the cache's are, so a pin is checked as before; one warning says every start unpacks
    again, and the fix."""
    from .pack import unpack

    cache_unwritable(entry, cause, "every start unpacks %s again (into a temporary directory)" % file.name)
    done = _PRIVATE.get(entry)
    if done is not None and _unpacked_problem(done, raw, usable) is None:
        return done
    target = staging.private_dir("laya-aot-pack-") / entry.name
    unpack(file, target)
    _PRIVATE[entry] = target
    return target


def _unpacked_problem(target: Path, raw: bytes, usable: List[Any]) -> Optional[str]:
    """Why the cache's directory `target` is not the pack whose manifest bytes are `raw` (None: it is): its
    bundle.json must be those bytes (a regular file, bounded: `files.read_cache_bytes`) and the files of the
    artifacts usable here at their sizes and sha256 (hashed on every start: files in the cache are never taken on a
    digest entry's word, `files.cached_sha256`)."""
    if read_cache_bytes(target / MANIFEST, MAX_MANIFEST_BYTES) != raw:
        return "its %s is not the pack's" % MANIFEST
    return check_files(target, {rel: rec for a in usable for rel, rec in a.files.items()}, cached_sha256)


def _choose_pack(d: Path, device: Optional[str], checkpoint: Optional[Path]) -> Path:
    """The pack of a directory of packs with the most artifacts usable here (of the checkpoint, when known)."""
    from .pack import read_pack_manifest

    cands = [(p, read_pack_manifest(p)) for p in sorted(d.glob("*" + PACK_SUFFIX))]
    prints = {m.checkpoint.fingerprint.sha256 for _, m in cands}
    if len(prints) > 1:
        if checkpoint is None:
            raise BundleError("%s holds packs of %d checkpoints; name the pack file itself" % (d, len(prints)))
        from ..checkpoint import fingerprint, mismatch

        cands = [(p, m) for p, m in cands if mismatch(m, checkpoint) is None]
        if not cands:
            raise BundleError("no pack in %s was built from checkpoint %s (fingerprint %s...); build and pack one"
                              % (d, checkpoint, fingerprint(checkpoint)["sha256"][:12]))
    scored = [(-len(usable_here(m, device)[0]), i, p) for i, (p, m) in enumerate(cands)]
    best = min(scored)[2]
    log.info("directory of packs %s: using %s", d, best.name)
    return best


def _hub_error(spec: str, what: str, e: BaseException) -> BundleError:
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    fix = ("HF_HUB_OFFLINE is set and the cache does not hold it: fetch it once online (`laya-aot fetch %s`)"
           % spec if offline else "check the address and revision, HF_TOKEN for a private repository, and the "
           "network (HF_ENDPOINT for a mirror)")
    return BundleError("cannot fetch %s of %s from the Hugging Face Hub (%s: %s); %s"
                       % (what, spec, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "", fix))


def _from_hub(spec: str, device: Optional[str], out: Optional[Path], overwrite: bool = False) -> Fetched:
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    repo, sub, revision = parse_hf(spec)

    def name(rel: str) -> str:
        return "%s/%s" % (sub, rel) if sub else rel

    try:
        mpath = Path(hf_hub_download(repo, name(MANIFEST), revision=revision))
    except Exception as e:  # noqa: BLE001 - the library's errors vary by cause; each becomes one message
        raise _hub_error(spec, MANIFEST, e) from None
    parts = mpath.parts
    commit = parts[parts.index("snapshots") + 1] if "snapshots" in parts else (revision or "main")
    raw = mpath.read_bytes()
    manifest = parse_bundle(raw, kinds.BY_NAME, "%s:%s" % (spec, MANIFEST), "publish a bundle written by laya-aot")
    if any(a.built and not a.files for a in manifest.artifacts):
        raise BundleError("%s: its manifest lists no files per artifact (schema %d), so one variant cannot be "
                          "fetched; publish a bundle written by this laya-aot (`laya-aot merge` or `build`)"
                          % (spec, manifest.schema_version))
    ok, skipped = usable_here(manifest, device)
    wanted: Dict[str, FileRecord] = {rel: rec for a in ok for rel, rec in a.files.items()}
    local: Dict[str, Path] = {}
    downloaded = 0
    with progress.task("fetch %s" % spec, total=sum(r.size for r in wanted.values()), unit="bytes") as line:
        for rel in sorted(wanted):
            cached = try_to_load_from_cache(repo, name(rel), revision=commit)
            downloaded += not isinstance(cached, str)
            try:
                local[rel] = Path(hf_hub_download(repo, name(rel), revision=commit))
            except Exception as e:  # noqa: BLE001
                raise _hub_error(spec, rel, e) from None
            line.advance(wanted[rel].size)
    folder = "%s--%s" % tuple(repo.split("/"))
    target = out or cache_dir() / "hub" / folder / commit / (sub.replace("/", "--") or "_")
    _link_bundle(target, raw, local, wanted, spec, overwrite, cache=out is None)  # the cache's own: made again
    log.info("fetched %s: %s (%d files, %d downloaded)", spec, ", ".join(a.name for a in ok) or "nothing usable",
             len(wanted), downloaded)
    return Fetched(target, spec, [a.name for a in ok], skipped, len(wanted), sum(r.size for r in wanted.values()),
                   downloaded)


def _link_bundle(target: Path, raw: bytes, local: Dict[str, Path], wanted: Dict[str, FileRecord], spec: str,
                 overwrite: bool = False, cache: bool = False) -> None:
    """A bundle directory at `target` (`cache`: laya-aot's cache entry, replaced whatever it holds) of the
    manifest's bytes and the fetched files (hard links, or copies)."""
    if (read_cache_bytes(target / MANIFEST, MAX_MANIFEST_BYTES) == raw
            and check_files(target, wanted, cached_sha256) is None):
        return  # fetched before (another device's variant may be missing: then it is made again below)
    staging.may_replace(target, "fetch", overwrite, cache=cache)
    with staging.staged(target) as tmp:
        for rel, src in local.items():
            dst = tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src.resolve(), dst)
            except OSError:
                shutil.copyfile(src, dst)
        why = check_files(tmp, wanted, cached_sha256)
        if why:
            raise BundleError("the files fetched from %s do not match its manifest (%s); the repository was changed "
                              "by hand or the download was damaged: fetch again, or rebuild and publish" % (spec, why))
        (tmp / MANIFEST).write_bytes(raw)


__all__ = ["Fetched", "fetch", "packed", "parse_hf", "resolve", "resolve_for_load"]
