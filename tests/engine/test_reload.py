"""Fail-closed start-up, the explicit fallback, and all-or-nothing reloads under concurrency."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import pytest

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.layout_engine import shipped_rules_dir
from kvpolicy.policy import Placement, RuleLoadError
from kvpolicy.policy.layouts import Layout

SPEC = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}
OFFLOAD = {"spec": SPEC, "connector": "OffloadingConnector"}


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    root = tmp_path / "rules"
    shutil.copytree(shipped_rules_dir(), root)
    return root


def test_invalid_rules_raise_by_default(rules_dir: Path) -> None:
    (rules_dir / "global.yaml").write_text("version: 1\nrules: [oops\n")
    with pytest.raises(RuleLoadError, match="invalid YAML"):
        LayoutEngine.from_path(rules_dir)


def test_fallback_allows_only_per_layer_and_logs(rules_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    (rules_dir / "global.yaml").write_text("version: 1\nrules: [oops\n")
    with caplog.at_level(logging.ERROR, logger="kvpolicy"):
        engine = LayoutEngine.from_path(rules_dir, on_error="fallback")
    assert engine.is_fallback and isinstance(engine.load_error, RuleLoadError)
    assert "falling back to per_layer only" in caplog.text and "global.yaml:" in caplog.text
    d = engine.decide(**OFFLOAD)
    assert d.layout.placement is Placement.per_layer
    assert [r.id for r, _ in d.eliminated[Layout.BLNHC]] == ["kvpolicy-fallback-per-layer"]


def test_reload_swaps_only_a_complete_rule_set(rules_dir: Path) -> None:
    engine = LayoutEngine.from_path(rules_dir, shipped_rules=False)  # the copy replaces the shipped rules
    assert engine.decide(**OFFLOAD).layout.placement is Placement.cross_layer
    old_digest = engine.ruleset.digest

    # a broken edit: the active set stays, the error is returned
    (rules_dir / "connectors" / "offloading.yaml").write_text("version: 1\nconnector: OffloadingConnector\nrules: 3\n")
    err = engine.reload()
    assert isinstance(err, RuleLoadError) and "offloading.yaml" in err.render()
    assert engine.ruleset.digest == old_digest
    assert engine.decide(**OFFLOAD).layout.placement is Placement.cross_layer

    # a good edit: swapped in
    (rules_dir / "connectors" / "offloading.yaml").write_text("version: 1\nconnector: OffloadingConnector\nrules: []\n")
    assert engine.reload() is None
    assert engine.ruleset.digest != old_digest
    assert engine.decide(**OFFLOAD).layout.placement is Placement.per_layer


def test_reload_recovers_from_fallback(rules_dir: Path) -> None:
    good = (rules_dir / "global.yaml").read_text()
    (rules_dir / "global.yaml").write_text("version: 1\nrules: [oops\n")
    engine = LayoutEngine.from_path(rules_dir, on_error="fallback", shipped_rules=False)
    (rules_dir / "global.yaml").write_text(good)
    assert engine.reload() is None
    assert not engine.is_fallback
    assert engine.decide(**OFFLOAD).layout.placement is Placement.cross_layer


def test_concurrent_decides_see_old_or_new_never_a_mix(tmp_path: Path) -> None:
    """Two rule sets that differ in a global forbid and a connector prefer: a mix of the
    two would be visible as a decision whose trace names rules from both sets."""
    a, b = tmp_path / "a", tmp_path / "b"
    for root, tag, placement in ((a, "a", "cross_layer"), (b, "b", "per_layer")):
        (root / "connectors").mkdir(parents=True)
        (root / "global.yaml").write_text(
            f"version: 1\nrules:\n  - id: global-{tag}\n    description: d\n    prefer: {{placement: {placement}}}\n")
        (root / "connectors" / "off.yaml").write_text(
            f"version: 1\nconnector: OffloadingConnector\nrules:\n  - id: conn-{tag}\n    description: d\n"
            f"    prefer: {{placement: {placement}}}\n    weight: 2\n")
    engine = LayoutEngine.from_path(a, shipped_rules=False)
    ctx = engine.context(**OFFLOAD)
    seen: set[tuple[str, ...]] = set()
    errors: list[BaseException] = []
    stop = threading.Event()

    def decider() -> None:
        try:
            while not stop.is_set():
                d = engine.decide(ctx, explain=True)
                ids = tuple(sorted(e.rule.id for e in d.rule_results))
                assert ids in (("conn-a", "global-a"), ("conn-b", "global-b")), ids
                assert (d.layout.placement is Placement.cross_layer) == (ids[0] == "conn-a")
                seen.add(ids)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=decider) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(60):
        assert engine.reload(b if i % 2 == 0 else a) is None
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors[0]
    assert seen == {("conn-a", "global-a"), ("conn-b", "global-b")}
