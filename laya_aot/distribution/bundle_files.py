"""The files a manifest names, checked on disk: what merge, pack, unpack and fetch agree a bundle is.

A bundle is its manifest plus, per built artifact, the files listed in `Artifact.files` (schema 2:
path, sha256, size). Nothing else in a bundle directory travels. A schema-1 manifest lists no files:
they are listed here from the artifact's path and accepted only when they add up to its sha256.
"""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from ..files import sha256_file
from ..manifest import Artifact, Bundle, BundleError, FileRecord, bundle_file, files_digest, record_files


def files_of(bundle: Path, art: Artifact) -> Tuple[Dict[str, FileRecord], Optional[str]]:
    """The artifact's file records, and why they cannot be trusted (None: they can)."""
    if art.files:
        return dict(art.files), None
    probe = replace(art, files={})
    if not (bundle / str(art.path)).exists():
        return {}, "%s is missing" % art.path
    record_files(bundle, probe)  # schema 1: list them from disk; they must add up to the recorded digest
    if files_digest(probe) != art.sha256:
        return {}, "the files under %s do not match the manifest's sha256 (changed after the build)" % art.path
    return probe.files, None


def manifest_files(bundle: Bundle) -> Dict[str, FileRecord]:
    """Every file a manifest names (schema 2), by its path in the bundle."""
    out: Dict[str, FileRecord] = {}
    for a in bundle.artifacts:
        if a.built:
            out.update(a.files)
    return out


def check_files(root: Path, files: Dict[str, FileRecord], digest: Callable[[Path], str] = sha256_file,
                limit: int = 5) -> Optional[str]:
    """None when every listed file is a regular file (no link) of the recorded size and sha256, else why."""
    bad = []
    for rel, rec in sorted(files.items()):
        try:
            p = bundle_file(root, rel, "file %s" % rel)  # no link on the way, not only the last component
            st = os.lstat(p)
        except BundleError as e:
            bad.append(str(e).split(";")[0])
            continue
        except FileNotFoundError:
            bad.append("%s is missing" % rel)
            continue
        except OSError as e:
            bad.append("%s cannot be read (%s)" % (rel, e.strerror or e))
            continue
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:  # fetch links the Hub's cache in; packing reads it once
            log.info("%s has %d hard links: its bytes are hashed as they are read, wherever else it appears",
                     rel, st.st_nlink)
        if not stat.S_ISREG(st.st_mode):
            bad.append("%s is not a regular file" % rel)
        elif st.st_size != rec.size:
            bad.append("%s is %d bytes, the manifest says %d" % (rel, st.st_size, rec.size))
        elif digest(p) != rec.sha256:
            bad.append("%s has sha256 %s..., the manifest says %s..." % (rel, digest(p)[:12], rec.sha256[:12]))
        if len(bad) >= limit:
            break
    return "; ".join(bad) or None


log = logging.getLogger(__name__)
