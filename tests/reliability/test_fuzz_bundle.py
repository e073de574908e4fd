"""Fuzzed bundle.json files against load(strict=False), inspect and verify: nothing may kill the
service or escape as an internal exception.

Each example mutates the demo bundle's manifest (1-4 edits: a value replaced by another JSON value, a
key deleted, a list item duplicated, a number nudged, and edits aimed at what reaches native code: smoke
token ids, marker positions, question types, ranges, paths), sometimes re-hashing the smoke record and
the artifacts' file records as a careful attacker would, so the checks behind the hashes are reached
too. The worker process loads the bundle (probe child off: the service process itself faces the
manifest), answers one request through whatever was installed, and runs `inspect --json` (and, for
some examples, `verify`). Counted: worker deaths, exceptions escaping load(), and inspect/verify runs
that print a traceback or an internal error.
"""
from __future__ import annotations

import copy
import json
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laya_aot.files import write_bytes_atomic
from laya_aot.manifest import MANIFEST, SmokeRecord, smoke_digest

TALLY: Counter = Counter()
HEAVY_EXAMPLES = int(os.environ.get("LAYA_AOT_FUZZ_EXAMPLES", "2000"))

leaf = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 63),
                 st.sampled_from([-1, 0, 1, 2, 3, 255, 10 ** 9]), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=12),
                 st.sampled_from(["../../etc/passwd", "/etc/passwd", "aoti-cpu/../../x", "aoti-cpu", "cuda",
                                  "fp16", "tilelang", "compile", "onnx", "verified", "unverified", ""]))
json_value = st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=6), c,
                                                                                              max_size=4)),
                          max_leaves=12)


def _paths(node, keys=()):
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in children:
        yield keys + (k,)
        yield from _paths(v, keys + (k,))


def _at(data, keys):
    node = data
    for k in keys[:-1]:
        node = node[k]
    return node, keys[-1]


def _value(data, keys):
    """The value at `keys`, or "<absent>"."""
    try:
        for k in keys:
            data = data[k]
        return data
    except (KeyError, IndexError, TypeError):
        return "<absent>"


def _aimed(m):
    """Paths that feed native code or the file system: the ones worth most of the budget."""
    out = []
    for i in range(5):
        out.append(("smoke", "inputs", i, 0, 0) if i < 4 else ("smoke", "inputs", 4, 0))
    out += [("smoke", "inputs", 0, 1, 3), ("smoke", "inputs", 2, 1, 1), ("smoke", "input_dtypes", 0)]
    arts = m.get("artifacts") if isinstance(m.get("artifacts"), list) else []
    for j, a in enumerate(arts):   # an earlier edit may have made any of these another type
        ranges = a.get("ranges") if isinstance(a, dict) else None
        out += [("artifacts", j, "ranges", f) for f in (ranges if isinstance(ranges, dict) else {})]
        out += [("artifacts", j, f) for f in ("path", "kind", "dtype", "status", "needs", "device", "name")]
    ranges = m.get("ranges")
    out += [("ranges", f) for f in (ranges if isinstance(ranges, dict) else {})]
    out += [("checkpoint", "n_actions"), ("checkpoint", "fingerprint", "files")]
    return [p for p in out if _exists(m, p)] or [("schema",)]


def _exists(m, keys):
    try:
        node, k = _at(m, keys)
        node[k]
        return True
    except (KeyError, IndexError, TypeError):
        return False


@st.composite
def mutated(draw, base):
    m = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 4))):
        aimed = draw(st.booleans())
        paths = _aimed(m) if aimed else list(_paths(m))
        if not paths:
            break
        keys = paths[draw(st.integers(0, len(paths) - 1))]
        node, k = _at(m, keys)
        # aimed edits mostly keep the type (a number nudged), so they get past the reader to what runs
        op = draw(st.sampled_from(["nudge", "nudge", "nudge", "replace", "delete"] if aimed else
                                  ["replace", "replace", "nudge", "delete", "duplicate"]))
        if op == "nudge" and isinstance(node[k], int) and not isinstance(node[k], bool):
            node[k] = node[k] + draw(st.sampled_from([-1, 1, -10 ** 6, 10 ** 6, 2 ** 40, 50000]))
        elif op == "delete" and isinstance(node, dict):
            del node[k]
        elif op == "duplicate" and isinstance(node, list):
            node.insert(k, copy.deepcopy(node[k]))
        else:
            node[k] = draw(json_value)
    if draw(st.booleans()):
        _rehash(m)
    return m


def _rehash(m):
    """Make the smoke record's hash and the artifacts' file records agree with the edits."""
    smoke = m.get("smoke")
    try:
        smoke["sha256"] = smoke_digest(SmokeRecord(smoke["inputs"], smoke["input_dtypes"], smoke["reference"]))
    except (TypeError, KeyError, ValueError):
        pass


def _one(worker, fuzz_bundle, m, verify):
    text = json.dumps(m)
    write_bytes_atomic(fuzz_bundle / MANIFEST, text.encode())
    out = worker.ask(fuzz_bundle, text, verify=verify)
    if out is None:
        TALLY["deaths"] += 1
        return
    TALLY["examples"] += 1
    TALLY["backend " + out.get("backend", "-")] += 1
    for key in ("load_exc", "inspect_internal", "verify_internal"):
        if out[key]:
            TALLY[key] += 1
            TALLY.setdefault("first " + key, out[key])  # type: ignore[arg-type]
    if any("internal error" in r for r in out.get("reasons", [])):
        TALLY["load_internal"] += 1
        TALLY.setdefault("first load_internal", [r for r in out["reasons"] if "internal error" in r][0])
    if verify:
        TALLY["verified"] += 1
    if TALLY["drawn"] % 100 == 0:   # progress of a long run, for the record
        print("fuzz progress: %s" % {k: v for k, v in TALLY.items() if not k.startswith("first")}, flush=True)


def _report(n, worker, base):
    deaths = TALLY["deaths"]
    print("\nfuzz: %d examples, %d worker deaths, %s" % (n, deaths, dict(TALLY)))
    for d in worker.deaths:  # what killed it: the return code, the worker's last words, the edited fields
        m = json.loads(d["manifest"]) if d["manifest"] else {}
        edits = {"/".join(map(str, k)): _value(m, k) for k in _paths(m)
                 if _value(base, k) != _value(m, k) and not isinstance(_value(m, k), (dict, list))}
        print("worker death: returncode %s\nedits: %s\nstderr tail:\n%s"
              % (d["returncode"], json.dumps(edits, default=str)[:4000], d["stderr_tail"]))
    assert TALLY["examples"] + deaths >= n
    assert deaths == 0, (TALLY, worker.deaths)
    for key in ("load_exc", "inspect_internal", "verify_internal", "load_internal"):
        assert TALLY[key] == 0, (key, TALLY.get("first " + key))
    # a fuzzer that never got past the manifest reader proves little: some examples must load an artifact
    assert TALLY["backend aot:aoti"] + TALLY["backend aot:onnx"] > 0, TALLY


@pytest.fixture(scope="module")
def base(demo_bundle):
    return json.loads((demo_bundle / MANIFEST).read_text())


def _run(worker, fuzz_bundle, base, n, verify_every, seed_name):
    TALLY.clear()
    # the unmutated manifest serves from the AOTInductor package: what the mutations then attack
    write_bytes_atomic(fuzz_bundle / MANIFEST, json.dumps(base).encode())
    first = worker.ask(fuzz_bundle, "", verify=True)
    assert first and first["backend"] == "aot:aoti" and not first["verify_internal"], first

    @settings(max_examples=n, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data):
        m = data.draw(mutated(base), label="manifest")
        TALLY["drawn"] += 1
        _one(worker, fuzz_bundle, m, verify=TALLY["drawn"] % verify_every == 0)

    worker.deaths.clear()
    one()
    _report(n, worker, base)


def test_fuzzed_manifests_never_kill_or_escape(worker, fuzz_bundle, base):
    _run(worker, fuzz_bundle, base, 200, 20, "ci")


@pytest.mark.heavy
def test_fuzzed_manifests_never_kill_or_escape_heavy(worker, fuzz_bundle, base):
    _run(worker, fuzz_bundle, base, HEAVY_EXAMPLES, 8, "heavy")
