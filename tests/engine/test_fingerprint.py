"""Layout fingerprints: canonical, stable across processes and rule-file order, sensitive to every field."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpolicy.engine import LayoutEngine, shipped_rules_dir
from kvpolicy.engine.fingerprint import (
    FORMAT_VERSION,
    LayoutFingerprint,
    canonical_kv_cache_dtype,
    describe,
    fingerprint,
    fingerprint_of,
)
from kvpolicy.engine.plan import plan_layout
from kvpolicy.policy import (
    AttentionKind,
    InputError,
    KVCacheGroup,
    KVCacheGroups,
    KVCacheSpec,
    Layout,
    load_rules,
    load_rules_from_texts,
)
from kvpolicy.policy.backends import BACKENDS
from kvpolicy.policy.releases import get_profile, iter_profiles

ROOT = Path(__file__).resolve().parents[2]
ENGINE = LayoutEngine.default()

# Qwen2.5-0.5B, the geometry of docs/fingerprint.md's worked example.
QWEN = {"num_layers": 24, "block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": "bfloat16"}
CROSS_HND = Layout.parse("BHLNC")


def make_spec(**overrides: object) -> KVCacheSpec:
    return KVCacheSpec(**{**QWEN, **overrides})


def fp(layout: Layout = CROSS_HND, backend: str = "TRITON_ATTN", **spec: object) -> LayoutFingerprint:
    return fingerprint_of(layout, make_spec(**spec), BACKENDS[backend])


# INVARIANT: this digest pins fingerprint format 2. If this test fails, the canonical
# form changed: every deployed peer would now disagree with this version. Either undo
# the change, or bump kvpolicy.engine.fingerprint.FORMAT_VERSION, document the change in
# docs/fingerprint.md, and pin the new digest here.
GOLDEN_QWEN_TRITON_CROSS_HND = "sha256:a7e966428f53c3918c8707a48cb958bff4369a59f0e2280717ddbfc5a02720ad"


def test_golden_digest_of_qwen_on_triton_cross_layer_hnd() -> None:
    f = fp()
    assert f.format_version == FORMAT_VERSION == 2
    # vLLM's own log line for this cache: (176452, 2, 24, 2, 16, 64) with 176452 blocks
    assert f.physical_shape == ("B", 2, 24, 2, 16, 64)
    assert f.physical_dims == ("block", "head", "layer", "kv", "token", "dim")
    assert f.digest == GOLDEN_QWEN_TRITON_CROSS_HND


def test_decision_fingerprint_matches_fingerprint_of() -> None:
    d = ENGINE.decide(spec=QWEN, backend="TRITON_ATTN", connector="NixlConnector",
                      connector_config={"enable_cross_layers_blocks": "true"})
    assert d.layout == CROSS_HND
    assert fingerprint(d) == fp()
    assert fingerprint(d).digest == GOLDEN_QWEN_TRITON_CROSS_HND


def test_canonical_json_and_key_order() -> None:
    f = fp(kv_cache_dtype="fp8_per_token_head")
    text = f.to_json()
    assert " " not in text
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    keys = list(f.to_dict())
    assert keys[:4] == ["format_version", "placement", "head_order", "backend"]
    assert keys[-1] == "groups"
    assert f.digest == "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def test_round_trip_through_dict_and_json() -> None:
    for f in (fp(), fp(kv_cache_dtype="int4_per_token_head", page_size_padded=4096),
              fingerprint_of(Layout.parse("LBNHC"),
                             KVCacheSpec(kind="mla", num_layers=27, block_size=64, num_kv_heads=1, head_size=576),
                             BACKENDS["FLASHMLA"])):
        assert LayoutFingerprint.from_dict(f.to_dict()) == f
        assert LayoutFingerprint.from_json(f.to_json()) == f
        assert LayoutFingerprint.from_dict(json.loads(f.to_json())).digest == f.digest


MLA_SPEC = {"kind": "mla", "num_layers": 27, "block_size": 64, "num_kv_heads": 1, "head_size": 576}


@pytest.mark.parametrize("profile, backend", [(p.name, b) for p in iter_profiles() for b in p.backend_names()])
def test_the_fingerprint_names_the_layout_it_was_made_of(profile: str, backend: str) -> None:
    """Placement and head order alone name three layouts each (LBHNC and LHBNC are both
    per_layer/HND); a peer rebuilding the layout from a fingerprint gets the one it was made
    of, or, where the backend stores no head dim (MLA), one whose bytes are the same."""
    backend_profile = get_profile(profile).backend(backend)
    spec = KVCacheSpec(**MLA_SPEC) if backend_profile.mla else make_spec()
    assert backend_profile.orders
    for layout in backend_profile.orders:
        f = fingerprint_of(layout, spec, backend_profile)
        rebuilt = LayoutFingerprint.from_json(f.to_json()).layout
        assert fingerprint_of(rebuilt, spec, backend_profile) == f, (profile, backend, layout)
        if "head" in f.physical_dims:
            assert rebuilt == layout, (profile, backend, layout, f.physical_dims)


@pytest.mark.parametrize(
    "dims, message",
    [
        (["block", "layer", "head", "token", "kv", "dim"], "not how backend `FLASH_ATTN` lays out a per_layer/HND"),
        (["layer", "block", "token", "head", "kv", "dim"], "not how backend `FLASH_ATTN` lays out a per_layer/HND"),
        (["foo", "bar"], "names 'foo', 'bar', not dims of a KV cache"),
        ([], "`physical_shape` has"),
        (["layer", "layer", "head", "token", "kv", "dim"], "names a dim twice"),
        (["layer", "block", "head", "token", "kv", "dim"] * 1000, "names a dim twice"),
    ],
)
def test_from_dict_refuses_dims_that_contradict_the_layout(dims: list[str], message: str) -> None:
    """A peer's physical dims must be the order of its own placement and head order: they are
    what `.layout` is read from (found by a hostile pass: BLHNC's dims under an LBHNC name loaded)."""
    d = fingerprint_of(Layout.LBHNC, make_spec(), get_profile("vllm-0.34").backend("FLASH_ATTN")).to_dict()
    d["physical_dims"] = dims
    with pytest.raises(InputError, match="not a layout fingerprint") as info:
        LayoutFingerprint.from_dict(d)
    assert message in str(info.value)
    assert info.value.diagnostics[0].file == "fingerprint.physical_dims"


def test_a_backend_no_profile_knows_is_checked_by_the_order_of_its_dims() -> None:
    """A newer peer's backend: its dims are accepted when they are the order of its layout."""
    d = fingerprint_of(Layout.LHBNC, make_spec(), get_profile("vllm-0.34").backend("FLASH_ATTN")).to_dict()
    d["backend"] = "SOME_NEW_BACKEND"
    assert LayoutFingerprint.from_dict(d).layout == Layout.LHBNC
    d["physical_dims"] = ["block", "layer", "head", "token", "kv", "dim"]
    with pytest.raises(InputError, match="not the order of any per_layer/HND layout"):
        LayoutFingerprint.from_dict(d)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format_version=3), "fingerprint format `3`"),
        (lambda d: d.pop("page_bytes"), "missing `page_bytes`"),
        (lambda d: d.update(num_blocks=10), "unknown `num_blocks`"),
        (lambda d: d.update(block_size="16"), "wrong type or value for `block_size`"),
        (lambda d: d.update(physical_shape=["B", 2, "x"]), "wrong type or value for `physical_shape`"),
        (lambda d: d.update(groups=[{"kind": "full"}]), "wrong type or value for `groups`"),
        # values no layout has: a peer's size of 0 or -1, no groups, a negative scale (hostile pass, issue 23)
        (lambda d: d.update(num_layers=0), "wrong type or value for `num_layers`"),
        (lambda d: d.update(block_size=-16), "wrong type or value for `block_size`"),
        (lambda d: d.update(num_buffers=0, kv_factor=-1), "wrong type or value for `num_buffers`, `kv_factor`"),
        (lambda d: d.update(groups=[]), "wrong type or value for `groups`"),
        (lambda d: d["groups"][0].update(page_bytes=0), "wrong type or value for `groups`"),
        (lambda d: d.update(scale_bytes=-4), "wrong type or value for `scale_bytes`"),
    ],
)
def test_from_dict_rejects_what_is_not_a_fingerprint(mutate, message: str) -> None:
    data = fp().to_dict()
    mutate(data)
    with pytest.raises(InputError, match=re.escape(message)):
        LayoutFingerprint.from_dict(data)


def test_shape_template_is_the_planned_shape_for_any_num_blocks() -> None:
    cases = [(lay, kv) for lay in ("LBNHC", "LBHNC", "BLNHC", "BHLNC")
             for kv in ("auto", "fp8", "fp8_per_token_head", "int4_per_token_head")]
    for name, kv in cases:
        layout, spec, backend = Layout.parse(name), make_spec(kv_cache_dtype=kv), BACKENDS["FLASHINFER"]
        f = fingerprint_of(layout, spec, backend)
        for num_blocks in (1, 7, 176452):
            plan = plan_layout(layout, spec, backend, num_blocks)
            assert len(plan.buffers) == f.num_buffers
            assert tuple(f.physical_dims) == plan.physical_dims
            shape = tuple(num_blocks if s == "B" else s for s in f.physical_shape)
            assert all(b.shape == shape for b in plan.buffers), (name, kv)
            assert plan.page_size_bytes == f.page_bytes


def test_scale_placement() -> None:
    assert fp().scale_placement == "none" and fp().scale_offset is None
    assert fp(kv_cache_dtype="fp8").scale_placement == "none"  # the per-tensor scale lives outside the cache
    f = fp(kv_cache_dtype="fp8_per_token_head")
    assert (f.scale_placement, f.scale_dtype, f.scale_bytes, f.scale_offset, f.cell_bytes) == (
        "inline_tail", "float32", 4, 64, 68)
    assert f.page_bytes == 4352  # docs/fingerprint.md: 4096 data + 256 scales
    f = fp(kv_cache_dtype="int4_per_token_head")
    assert (f.scale_offset, f.cell_bytes) == (32, 36)


def test_spellings_of_one_format_agree() -> None:
    assert fp(kv_cache_dtype="auto") == fp(kv_cache_dtype="bfloat16")
    assert fp(kv_cache_dtype="fp8") == fp(kv_cache_dtype="fp8_e4m3")
    assert canonical_kv_cache_dtype(make_spec(kv_cache_dtype="auto", dtype="float16")) == "float16"
    assert fp(kv_cache_dtype="fp8_e4m3") != fp(kv_cache_dtype="fp8_e5m2")


def test_every_field_changes_the_digest() -> None:
    base = fp()
    variants = {
        "head_order": fp(layout=Layout.parse("BLNHC")),
        "placement": fp(layout=Layout.parse("LBHNC")),
        "backend (same geometry, other name)": fp(backend="FLASH_ATTN"),
        "backend (other geometry)": fp(backend="FLASHINFER"),
        "dtype": fp(dtype="float16"),
        "quant mode fp8": fp(kv_cache_dtype="fp8"),
        "quant mode fp8_e5m2": fp(kv_cache_dtype="fp8_e5m2"),
        "quant mode fp8_per_token_head": fp(kv_cache_dtype="fp8_per_token_head"),
        "quant mode int8_per_token_head": fp(kv_cache_dtype="int8_per_token_head"),
        "quant mode int4_per_token_head": fp(kv_cache_dtype="int4_per_token_head"),
        "num_layers": fp(num_layers=28),
        "block_size": fp(block_size=32),
        "num_kv_heads": fp(num_kv_heads=4),
        "head_size": fp(head_size=128),
        "page padding": fp(page_size_padded=8192 + 512),
        "kind": fp(kind="sliding_window", sliding_window=4096),
        "groups": fingerprint_of(CROSS_HND, make_spec(), BACKENDS["TRITON_ATTN"], KVCacheGroups(groups=(
            KVCacheGroup(spec=make_spec()),
            KVCacheGroup(spec=make_spec(kind=AttentionKind.mamba, num_layers=4, num_kv_heads=1, head_size=16)),
        ))),
    }
    digests = {name: f.digest for name, f in variants.items()}
    for name, digest in digests.items():
        assert digest != base.digest, name
    assert len(set(digests.values())) == len(digests), "two different variants share a digest"


def test_num_blocks_is_not_part_of_the_fingerprint() -> None:
    f = fp()
    assert "num_blocks" not in f.to_dict()
    assert f.physical_shape[0] == "B"
    # one fingerprint serves every pool size: the plans for any num_blocks all match its template
    shapes = {plan_layout(CROSS_HND, make_spec(), BACKENDS["TRITON_ATTN"], n).buffers[0].shape[1:] for n in (1, 9, 99)}
    assert shapes == {tuple(f.physical_shape[1:])}


def _shipped_texts() -> dict[str, str]:
    root = shipped_rules_dir()
    files = sorted(root.glob("*.yaml")) + sorted((root / "connectors").glob("*.yaml"))
    return {p.relative_to(root).as_posix(): p.read_text() for p in files}


CONTEXTS = [
    {"spec": QWEN, "backend": "TRITON_ATTN", "connector": "OffloadingConnector"},
    {"spec": QWEN, "backend": "TRITON_ATTN", "connector": "OffloadingConnector",
     "kv_cache_dtype": "fp8_per_token_head"},
    {"spec": QWEN, "backend": "FLASHINFER", "connector": "NixlConnector",
     "connector_config": {"enable_cross_layers_blocks": "true"}},
    {"spec": QWEN, "backend": "FLASH_ATTN", "connector": "LMCacheConnectorV1"},
    {"spec": QWEN, "backend": "FLASH_ATTN"},
]


def test_rule_file_order_does_not_change_fingerprints() -> None:
    texts = _shipped_texts()
    expected = [fingerprint(ENGINE.decide(**c)).digest for c in CONTEXTS]
    rng = random.Random(7)
    for _ in range(5):
        names = list(texts)
        rng.shuffle(names)
        engine = LayoutEngine(load_rules_from_texts({n: texts[n] for n in names}))
        assert [fingerprint(engine.decide(**c)).digest for c in CONTEXTS] == expected
        assert engine.ruleset.digest == ENGINE.ruleset.digest


def test_rule_set_digest_is_beside_not_inside(tmp_path: Path) -> None:
    texts = _shipped_texts()
    texts["extra.yaml"] = ("version: 1\nrules:\n  - id: harmless\n    description: never matches\n"
                           "    when: {field: kv.block_size, eq: 12345}\n    forbid: {placement: cross_layer}\n")
    other = LayoutEngine(load_rules_from_texts(texts))
    for c in CONTEXTS:
        a, b = ENGINE.decide(**c), other.decide(**c)
        assert a.ruleset.digest != b.ruleset.digest
        assert describe(a)["digest"] == describe(b)["digest"] == fingerprint(a).digest
        assert describe(a)["ruleset_digest"] == a.ruleset.digest
        assert describe(a)["fingerprint"] == fingerprint(a).to_dict()


_CHILD = """
import json
from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.fingerprint import fingerprint
from kvpolicy.policy import load_rules
engine = LayoutEngine(load_rules({rules!r}))
print(json.dumps([fingerprint(engine.decide(**c)).digest for c in {contexts!r}]))
"""


def test_identical_in_fresh_processes_with_any_hash_seed() -> None:
    expected = [fingerprint(ENGINE.decide(**c)).digest for c in CONTEXTS]
    code = _CHILD.format(rules=str(shipped_rules_dir()), contexts=CONTEXTS)
    for seed in ("0", "1", "4242", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=60, check=True)
        assert json.loads(out.stdout) == expected, seed
    assert load_rules(shipped_rules_dir()).digest == ENGINE.ruleset.digest


def test_fingerprint_and_agreement_do_not_import_torch() -> None:
    code = ("import sys, kvpolicy.engine.fingerprint, kvpolicy.engine.agreement, kvpolicy.engine.integrations.vllm\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         check=True)
    assert out.stdout.strip() == "False"


def test_docs_describe_every_field() -> None:
    doc = (ROOT / "docs" / "fingerprint.md").read_text()
    for key in fp().to_dict():
        assert f"| `{key}` |" in doc, key
    for key in fp().to_dict()["groups"][0]:
        assert f"| `groups[].{key}` |" in doc, key
    assert GOLDEN_QWEN_TRITON_CROSS_HND in doc
