"""The typed manifest: strict reading, one error naming the field, never an internal exception.

The fuzz test mutates a real bundle's manifest (tests/shared/demo_manifest.json: the demo bundle's, kept as
data so that these tests need no build; a field deleted, a value of another type, an unknown
kind) and reads it: it must either read (the field is free-form or optional) or raise BundleError
naming the mutated field or one above it.
"""
from __future__ import annotations

import copy
import json
import re
import warnings
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import laya_aot
from laya_aot import kinds
from laya_aot.bundle_format import read_bundle
from laya_aot.manifest import MANIFEST, SCHEMA_VERSION, Bundle, BundleError

OUTCOMES: Counter = Counter()
WRONG = [None, True, 0, -3, 2.5, "", "tpu", [], [1, "x"], {}, {"a": 1}]


def _paths(node, keys=()):
    """The keys leading to every field of the manifest (list items: the first three)."""
    children = node.items() if isinstance(node, dict) else enumerate(node[:3]) if isinstance(node, list) else ()
    for k, v in children:
        yield keys + (k,)
        yield from _paths(v, keys + (k,))


def _parent(data, keys):
    node = data
    for k in keys[:-1]:
        node = node[k]
    return node, keys[-1]


def _check(data, keys):
    try:
        Bundle.from_dict(data, kinds.NAMES)
    except BundleError as e:
        msg = str(e)
        # the error names the mutated field or a field above it (an envelope field names itself)
        named = [p for p in _prefixes(keys) if p in msg]
        assert named or keys[0] in ("schema", "schema_version"), (keys, msg)
        assert "rebuild" in msg or "upgrade" in msg or "point bundle=" in msg, msg
        return "refused"
    return "read"


def _prefixes(keys):
    out, cur = [], ""
    for k in keys:
        cur = "%s[%d]" % (cur, k) if isinstance(k, int) else ("%s.%s" % (cur, k) if cur else k)
        out.append(cur)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_manifests_are_read_or_refused_naming_the_field(manifest, data):
    keys = data.draw(st.sampled_from(list(_paths(manifest))), label="field")
    mutated = copy.deepcopy(manifest)
    parent, key = _parent(mutated, keys)
    how = data.draw(st.sampled_from(["delete", "replace", "unknown_kind"]), label="how")
    if how == "delete" and isinstance(parent, dict):
        del parent[key]
    elif how == "unknown_kind":
        mutated["artifacts"][data.draw(st.integers(0, len(mutated["artifacts"]) - 1))]["kind"] = "tensorrt"
        keys = ("artifacts",)
    else:
        parent[key] = data.draw(st.sampled_from(WRONG), label="value")
    OUTCOMES[_check(mutated, keys)] += 1


@pytest.mark.parametrize("bad", [0, -1, 1 << 13])
def test_an_impossible_action_count_is_refused_naming_it(manifest, bad):
    """Found by the fuzzer: n_actions 0 was read, and the smoke record's width was blamed for it."""
    mutated = copy.deepcopy(manifest)
    mutated["checkpoint"]["n_actions"] = bad
    with pytest.raises(BundleError, match=r"checkpoint\.n_actions"):
        Bundle.from_dict(mutated, kinds.NAMES)


@pytest.mark.parametrize("field,bad", [("min_tokens", 15), ("max_tokens", 100), ("token_multiple", 8),
                                       ("token_multiple", 15)])
def test_a_token_range_the_export_cannot_take_is_refused_naming_it(manifest, field, bad):
    """Found by the fuzzer: a manifest edited to min_tokens 15 was read, and the artifact's warm-up call with 15
    tokens (its program takes 16 x Dim) killed the process with SIGFPE."""
    mutated = copy.deepcopy(manifest)
    art = next(a for a in mutated["artifacts"] if a.get("ranges"))
    art["ranges"][field] = bad
    with pytest.raises(BundleError, match=r"ranges\.%s" % field):
        Bundle.from_dict(mutated, kinds.NAMES)


def test_the_fuzzer_both_refused_and_accepted():
    # runs after the fuzz test: a fuzzer that only ever hit free-form fields would prove nothing
    assert OUTCOMES["refused"] >= 100 and OUTCOMES["read"] >= 10, OUTCOMES


def _shape(node, keys=()):
    """Every field path of a manifest, list positions left out: what a build writes, not its values."""
    children = node.items() if isinstance(node, dict) else [("[]", v) for v in node] if isinstance(node, list) else ()
    out = {keys}
    for k, v in children:
        if not (keys[-1:] == ("files",) or keys[-2:] == ("details", "inputs")):  # names of files and inputs
            out |= _shape(v, keys + (k,))
    return out


def test_the_sample_manifest_has_every_field_a_build_writes(manifest, demo_bundle):
    """The manifest the fast tests read (tests/shared/demo_manifest.json) is the demo bundle's: a build that
    writes a field the sample lacks would leave that field out of the fuzzing. To refresh the sample, copy
    a fresh demo bundle's bundle.json over it."""
    fresh = json.loads((demo_bundle / MANIFEST).read_text())
    missing = sorted(_shape(fresh) - _shape(manifest))
    assert not missing, "fields a build writes that tests/shared/demo_manifest.json lacks: %s" % missing[:20]
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert [(a["name"], a["kind"]) for a in manifest["artifacts"]] == \
        [(a["name"], a["kind"]) for a in fresh["artifacts"]]


def test_what_the_fuzzer_must_refuse_is_refused(manifest):
    """The same checks written out: each of these is a BundleError naming its field."""
    cases = {
        "artifacts[1].needs": lambda m: m["artifacts"][1].pop("needs"),
        "artifacts[1].needs.device": lambda m: m["artifacts"][1]["needs"].update(device="tpu"),
        "artifacts[0].kind": lambda m: m["artifacts"][0].update(kind="tensorrt"),
        "artifacts[2].status": lambda m: m["artifacts"][2].update(status="ok"),
        "artifacts[0].ranges.max_rows": lambda m: m["artifacts"][0]["ranges"].update(max_rows="64"),
        # more tokens than the checkpoint's context: verification would build cases that long (a fuzzed
        # 50256 once had the worker killed for memory)
        "artifacts[0].ranges.max_tokens": lambda m: m["artifacts"][0]["ranges"].update(max_tokens=50256),
        "checkpoint.max_len": lambda m: m["checkpoint"].update(max_len=0),
        "artifacts[1].sha256": lambda m: m["artifacts"][1].update(sha256=None),
        "checkpoint.fingerprint.sha256": lambda m: m["checkpoint"]["fingerprint"].pop("sha256"),
        "tolerance.fp32": lambda m: m["tolerance"].pop("fp32"),
        "smoke.inputs": lambda m: m["smoke"].update(inputs="x"),
        "artifacts[1].probe_verdict.key": lambda m: m["artifacts"][1]["probe_verdict"].update(key="../" * 20),
        "twice": lambda m: m["artifacts"].append(copy.deepcopy(m["artifacts"][0])),
    }
    for field, mutate in cases.items():
        m = copy.deepcopy(manifest)
        mutate(m)
        with pytest.raises(BundleError, match=re.escape(field)):
            Bundle.from_dict(m, kinds.NAMES)


@pytest.mark.parametrize("kernels, field", [
    ([{"path": "../lib.so"}], "details.kernels[0].path"),
    ([{"path": "a.so", "meta_path": "/etc/passwd"}], "details.kernels[0].meta_path"),
    ("a.so", "details.kernels"),
])
def test_a_kinds_details_are_checked_by_its_own_hook(manifest, kernels, field):
    """TileLang's `details.kernels` layout is checked by `kinds.tilelang.check_details`, which the reader asks."""
    m = copy.deepcopy(manifest)
    m["artifacts"][1].update(kind="tilelang", details={"kernels": kernels})
    with pytest.raises(BundleError, match=re.escape("artifacts[1].%s" % field)):
        Bundle.from_dict(m, kinds.BY_NAME)
    m["artifacts"][1]["details"] = {"kernels": [{"path": "a.so", "meta_path": "a.json"}]}
    Bundle.from_dict(m, kinds.BY_NAME)


def test_version_and_nesting_are_refused(manifest, bundle_copy):
    for version in (SCHEMA_VERSION + 1, 0, "1", True):
        with pytest.raises(BundleError, match="schema_version|newer than"):
            Bundle.from_dict(dict(manifest, schema_version=version), kinds.NAMES)
    text = json.dumps(manifest)
    (bundle_copy / MANIFEST).write_text(text[:-1] + ', "config": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(BundleError, match="nests too deeply"):
        read_bundle(bundle_copy, kinds.NAMES)


def test_round_trip_keeps_every_field(demo_bundle):
    bundle = read_bundle(demo_bundle, kinds.NAMES)
    again = Bundle.from_dict(json.loads(json.dumps(bundle.to_dict())), kinds.NAMES)
    assert again == bundle
    assert bundle.artifact("aoti-cpu").needs.device == "cpu" and bundle.tolerance.fp32 == 1e-4


@pytest.mark.parametrize("field, mutate", [
    ("artifacts[1].needs", lambda m: m["artifacts"][1].pop("needs")),
    ("artifacts[0].kind", lambda m: m["artifacts"][0].update(kind="tensorrt")),
    ("checkpoint", lambda m: m.update(checkpoint=[])),
])
def test_load_falls_back_naming_the_field(bundle_copy, demo_ckpt, field, mutate):
    m = json.loads((bundle_copy / MANIFEST).read_text())
    mutate(m)
    (bundle_copy / MANIFEST).write_text(json.dumps(m))
    with pytest.warns(RuntimeWarning, match=re.escape(field)):
        agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu")
    assert agent.backend == "eager"


def test_inspect_reports_a_bad_manifest_without_a_traceback(bundle_copy, capsys):
    from laya_aot.commands import inspect

    m = json.loads((bundle_copy / MANIFEST).read_text())
    m["artifacts"][0]["needs"] = "cpu"
    (bundle_copy / MANIFEST).write_text(json.dumps(m))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert inspect([str(bundle_copy)], 0.0) == 2
    err = capsys.readouterr().err
    assert "artifacts[0].needs" in err and "Traceback" not in err


def test_an_export_of_the_context_rounded_up_to_the_token_step_reads_and_one_beyond_it_does_not(manifest):
    """A checkpoint of context 200 is exported to 208 tokens (`padding.context_tokens`, the build's default): its
    manifest reads; 224 tokens for that context is more than the build ever exports, and is refused."""
    m = copy.deepcopy(manifest)
    m["checkpoint"]["max_len"] = 200
    for ranges in [m["ranges"]] + [art["ranges"] for art in m["artifacts"]]:
        ranges["max_tokens"] = 208
    assert Bundle.from_dict(m, kinds.BY_NAME).checkpoint.max_len == 200
    m["artifacts"][0]["ranges"]["max_tokens"] = 224
    with pytest.raises(BundleError, match=re.escape("artifacts[0].ranges.max_tokens") + ".*at most 208"):
        Bundle.from_dict(m, kinds.BY_NAME)


def test_a_latency_or_its_spread_that_is_not_milliseconds_costs_its_artifact(manifest):
    """The build's figures rank the artifacts: a negative or endless one marks its own artifact invalid, naming the
    field, and leaves the others usable."""
    for field in ("latency_ms", "latency_spread_ms"):
        m = copy.deepcopy(manifest)
        m["artifacts"][1][field]["cpu"]["1x128x4"] = -1.0
        read = Bundle.from_dict(m, kinds.NAMES).artifacts
        assert "%s.cpu.1x128x4" % field in (read[1].invalid or ""), field
        assert read[2].invalid is None
