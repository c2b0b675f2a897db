"""The public surface, pinned: what `kvpolicy`, `kvpolicy.policy`, `kvpolicy.engine` and
`kvpolicy.engine.runtime` export is exactly what we promise users, and nothing internal.

Adding a name is a decision: add it here too. Internals (compiled rules, the field and
backend registries, test helpers) stay importable from their modules, outside `__all__`.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ERRORS = {"Diagnostic", "GeometryError", "InputError", "MissingDependencyError", "ModelConfigError",
          "NoLayoutError", "PolicyError", "RuleLoadError"}
INPUTS = {"ConnectorConfig", "Context", "HeadOrder", "KVCacheGroup", "KVCacheGroups", "KVCacheSpec", "Layout",
          "Limits", "Placement", "QuantMode", "RuleSet", "load_rules"}
DECISION = {"CandidateRemoved", "Counterfactual", "Decision", "FieldChange", "LayoutChosen", "LayoutEngine",
            "LayoutFingerprint", "PreferenceApplied", "RuleEvaluated", "RuleRef", "fingerprint_of",
            "shipped_rules_dir"}
AGREEMENT = {"AgreementError", "CompatibilityResult", "LayoutMismatchError", "agree", "check_compatible",
             "require_compatible"}

PUBLIC = {
    "kvpolicy": ERRORS | INPUTS | DECISION | AGREEMENT,
    "kvpolicy.policy": ERRORS | INPUTS | {
        "ALL_LAYOUTS", "AttentionKind", "BackendProfile", "CacheDtype", "Dim", "KNOWN_CONNECTORS",
        "KV_CACHE_DTYPES", "LayoutPattern", "ModelDtype", "Rule", "RuleFile", "ScaleViews", "get_backend",
        "load_rules_from_texts", "parse_kv_cache_dtype"},
    "kvpolicy.engine": DECISION | AGREEMENT,
    "kvpolicy.engine.runtime": {"KVCache", "OffloadedBlocks", "allocate", "decode_cells", "encode_cells"},
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_are_exactly_these(module: str) -> None:
    mod = importlib.import_module(module)
    assert set(mod.__all__) == PUBLIC[module]
    assert len(mod.__all__) == len(set(mod.__all__))
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name
    assert PUBLIC[module] <= set(dir(mod))


def test_the_facade_is_the_implementations_objects() -> None:
    import kvpolicy
    import kvpolicy.engine
    import kvpolicy.policy

    for name in kvpolicy.__all__:
        home = kvpolicy.policy if name in kvpolicy.policy.__all__ else kvpolicy.engine
        assert getattr(kvpolicy, name) is getattr(home, name), name
    with pytest.raises(AttributeError, match="has no attribute 'CompiledRule'"):
        _ = kvpolicy.CompiledRule


def test_internals_stay_out_of_the_surface() -> None:
    import kvpolicy.engine.plan as plan
    import kvpolicy.policy as policy
    from kvpolicy.policy.backends import BACKENDS

    for name in ("CompiledRule", "Source", "MISSING", "BACKENDS", "FIELDS"):
        assert name not in policy.__all__
    assert "naive_scale_view" not in plan.__all__
    with pytest.raises(TypeError):  # the backend registry every decision shares is read-only
        BACKENDS["TRITON_ATTN"] = BACKENDS["FLASH_ATTN"]  # type: ignore[index]


def test_importing_the_facade_loads_neither_engine_nor_torch() -> None:
    code = ("import sys, kvpolicy\n"
            "assert not [m for m in sys.modules if m.startswith(('kvpolicy.engine', 'torch'))], sys.modules\n"
            "kvpolicy.LayoutEngine\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_python_m_kvpolicy_is_the_command_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvpolicy", "validate"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: ")
    proc = subprocess.run([sys.executable, "-m", "kvpolicy"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "usage: kvpolicy" in proc.stderr
