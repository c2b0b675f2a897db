"""No layer lifts a forbid (docs/rule-layers.md): whatever an operator's layer says, and under whatever
name it addresses a connector (its class or the alias vLLM loads it by), every layout that survives
the shipped rules plus that layer survived the shipped rules alone.

Property-based: hypothesis writes an operator layer (a global file and connector files named by class
or by alias, holding forbids, requires and prefers) and a deployment, for the gate releases and the
resolver releases; the surviving layouts with the layer are a subset of those without it. And the other
way: a forbid in the file of the class vLLM loads for the deployment (0.34's ``NixlConnector`` with
``transfer_mode: push`` is ``NixlPushConnector``) or of the name it configures always removes its layouts.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy.engine import LayoutEngine
from kvpolicy.policy.errors import NoLayoutError, PolicyError
from kvpolicy.policy.layouts import ALL_LAYOUTS

PROFILES = ("vllm-0.24", "vllm-0.28", "vllm-0.34")
# connectors as a deployment names them: NixlConnector is an alias of NixlPullConnector in every profile, and in
# vllm-0.34 of NixlPushConnector with kv_connector_extra_config `transfer_mode: push` (its factory's choice)
CONNECTORS = (None, "NixlConnector", "NixlPullConnector", "OffloadingConnector", "MultiConnector")
FILE_NAMES = ("NixlConnector", "NixlPullConnector", "NixlPushConnector", "OffloadingConnector", "MultiConnector")
LAYOUTS = tuple(str(x) for x in ALL_LAYOUTS)


def _effect() -> st.SearchStrategy[dict[str, Any]]:
    target = st.one_of(
        st.builds(lambda xs: {"layout": xs}, st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=3, unique=True)),
        st.builds(lambda p: {"placement": p}, st.sampled_from(["per_layer", "cross_layer"])),
        st.builds(lambda h: {"head_order": h}, st.sampled_from(["NHD", "HND"])),
        st.builds(lambda b: {"block_outermost": b}, st.booleans()),
    )
    return st.one_of(
        st.builds(lambda t: {"forbid": t}, target),
        st.builds(lambda t: {"require": t}, target),
        st.builds(lambda t, w: {"prefer": t, "weight": w}, target, st.integers(1, 1000)),
    )


_rules = st.lists(_effect(), max_size=3)


@st.composite
def layers(draw: st.DrawFn) -> dict[str, list[dict[str, Any]]]:
    """file name (``global`` or a connector) -> the rules it holds."""
    files = {"global": draw(_rules)}
    for name in draw(st.lists(st.sampled_from(FILE_NAMES), max_size=3, unique=True)):
        files[name] = draw(_rules)
    return files


deployments = st.fixed_dictionaries({
    "vllm_version": st.sampled_from(PROFILES),
    "connector": st.sampled_from(CONNECTORS),
    "enable_cross_layers_blocks": st.booleans(),
    "kv_cache_dtype": st.sampled_from(["auto", "fp8", "fp8_per_token_head"]),
    "attention_backend": st.sampled_from(["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"]),
    "vllm_kv_cache_layout": st.sampled_from([None, "NHD", "HND"]),
    "transfer_mode": st.sampled_from([None, "pull", "push"]),
})


def loaded_classes(d: dict[str, Any]) -> set[str]:
    """The connector classes vLLM loads for the deployment (written from each release's factory.py, which
    ``tests/conformance/test_release_facts.py`` checks the profiles against), and the names it configures."""
    def loads(name: str) -> str:
        if name != "NixlConnector":
            return name
        push = d["vllm_version"] == "vllm-0.34" and d.get("transfer_mode") == "push"
        return "NixlPushConnector" if push else "NixlPullConnector"
    names = {"MultiConnector", "OffloadingConnector", "NixlConnector"} if d["connector"] == "MultiConnector" else \
        {d["connector"]} - {None}
    return {*names, *(loads(n) for n in names)}


def _write(root: Path, files: dict[str, list[dict[str, Any]]]) -> None:
    (root / "connectors").mkdir(parents=True)
    for name, effects in files.items():
        rules = [{"id": f"site-{name.lower()}-{i}", "description": "an operator's rule", **e}
                 for i, e in enumerate(effects)]
        doc: dict[str, Any] = {"version": 1, "rules": rules}
        if name == "global":
            (root / "global.yaml").write_text(yaml.safe_dump(doc))
        else:
            (root / "connectors" / f"{name}.yaml").write_text(yaml.safe_dump({"version": 1, "connector": name,
                                                                              "rules": rules}))


def _inputs(d: dict[str, Any]) -> dict[str, Any]:
    inputs = {k: v for k, v in d.items() if k not in ("connector", "enable_cross_layers_blocks", "transfer_mode")}
    inputs["spec"] = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}
    if d["connector"] == "MultiConnector":
        inputs["kv_transfer_config"] = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"connectors": [
                                            {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
                                            {"kv_connector": "NixlConnector", "kv_role": "kv_both"}]}}
    elif d["connector"] is not None:
        inputs["connector"] = d["connector"]
        inputs["connector_config"] = {"enable_cross_layers_blocks": str(d["enable_cross_layers_blocks"]).lower(),
                                      **_mode(d)}
    return inputs


def _mode(d: dict[str, Any]) -> dict[str, Any]:
    return {} if d.get("transfer_mode") is None else {"transfer_mode": d["transfer_mode"]}


def _survivors(engine: LayoutEngine, inputs: dict[str, Any]) -> frozenset[str] | None:
    """The surviving layouts (empty when none survives), or None when the inputs are refused as inputs."""
    try:
        return frozenset(str(layout) for layout, _ in engine.decide(explain=False, **inputs).ranking)
    except NoLayoutError:
        return frozenset()
    except PolicyError:
        return None


@functools.cache
def _shipped(profile: str) -> LayoutEngine:
    return LayoutEngine.default(profile)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=layers(), deployment=deployments)
def test_an_operator_layer_never_revives_a_layout_the_shipped_rules_removed(
        files: dict[str, list[dict[str, Any]]], deployment: dict[str, Any]) -> None:
    inputs = _inputs(deployment)
    alone = _survivors(_shipped(deployment["vllm_version"]), inputs)
    with tempfile.TemporaryDirectory() as tmp:
        _write(Path(tmp) / "site", files)
        layered = LayoutEngine.from_path(Path(tmp) / "site", vllm_version=deployment["vllm_version"])
        with_site = _survivors(layered, inputs)
    if alone is None:  # the inputs themselves are refused: the layer cannot make them valid
        assert with_site is None
        return
    assert with_site is not None and with_site <= alone, (files, deployment, sorted(alone), sorted(with_site or ()))
    applies = {"global", *loaded_classes(deployment)}
    forbidden = {x for name, effects in files.items() if name in applies for e in effects
                 for x in e.get("forbid", {}).get("layout", ())}
    assert not with_site & forbidden, (files, deployment, sorted(with_site), sorted(forbidden))


def test_the_alias_reproduction_keeps_the_shipped_nixl_rules(tmp_path: Path) -> None:
    """Issue 23's case: under vLLM 0.28 a site file `connectors/NixlConnector.yaml` holding one prefer (vLLM
    loads NixlPullConnector for that name) used to hide the shipped NixlPullConnector rules, and the
    decision took BHLNC, which they remove."""
    _write(tmp_path / "site", {"global": [], "NixlConnector": [{"prefer": {"layout": ["BHLNC"]}, "weight": 100}]})
    inputs = _inputs({"vllm_version": "vllm-0.28", "connector": "NixlConnector", "enable_cross_layers_blocks": False,
                      "kv_cache_dtype": "auto", "attention_backend": "FLASH_ATTN", "vllm_kv_cache_layout": None})
    shipped = LayoutEngine.default("vllm-0.28").decide(**inputs)
    layered = LayoutEngine.from_path(tmp_path / "site", vllm_version="vllm-0.28").decide(**inputs)
    assert str(shipped.layout) == str(layered.layout) == "LBHNC"
    assert [str(x) for x, _ in layered.ranking] == [str(x) for x, _ in shipped.ranking] == ["LBHNC", "LBNHC"]
    removers = {e.rule.id for e in layered.events if getattr(e, "kind", None) == "removed"}
    assert "nixl-pull-cross-layer-needs-opt-in" in removers  # the shipped class's forbid, through the alias


def test_a_push_deployment_takes_the_push_rules_not_the_pull_rules(tmp_path: Path) -> None:
    """Issue 23's push alias: vLLM 0.34 loads NixlPushConnector for `NixlConnector` with `transfer_mode: push`;
    a site's NixlPushConnector forbid applies to that deployment, a NixlPullConnector one does not (nor the
    shipped pull rules), and a pull deployment is the other way round."""
    _write(tmp_path / "site", {"global": [], "NixlPushConnector": [{"forbid": {"layout": ["LBHNC"]}}],
                               "NixlPullConnector": [{"forbid": {"layout": ["LBNHC"]}}]})
    engine = LayoutEngine.from_path(tmp_path / "site", vllm_version="vllm-0.34")
    base = _inputs({"vllm_version": "vllm-0.34", "connector": "NixlConnector", "enable_cross_layers_blocks": False,
                    "kv_cache_dtype": "auto", "attention_backend": "FLASH_ATTN", "vllm_kv_cache_layout": None,
                    "transfer_mode": None})
    for mode, gone, kept in (("push", "LBHNC", "LBNHC"), ("pull", "LBNHC", "LBHNC"), (None, "LBNHC", "LBHNC")):
        extra = {} if mode is None else {"transfer_mode": mode}
        decision = engine.decide(**{**base, "connector_config": {**base["connector_config"], **extra}})
        survivors = {str(x) for x, _ in decision.ranking}
        assert gone not in survivors and kept in survivors, (mode, survivors)
        scopes = {Path(e.rule.source.file).name for e in decision.events if getattr(e, "rule", None)
                  and Path(e.rule.source.file).parent.name == "connectors"}
        assert scopes <= {f"Nixl{(mode or 'pull').capitalize()}Connector.yaml", "NixlConnector.yaml"}, (mode, scopes)

