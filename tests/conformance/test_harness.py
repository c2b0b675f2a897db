"""Smoke tests of the conformance harness itself: the installer's cache and both oracles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import install_vllm
import pytest
from vllm_release import run_oracle

INSTALLER = Path(__file__).resolve().parent / "install_vllm.py"


def test_installer_reuses_the_cache(vllm_sites):
    for version, site in vllm_sites.items():
        assert (site.parent / "COMPLETE").is_file()
        assert install_vllm.site_for(version) == site
        assert not (site / "torch").exists(), "the site must use the project's torch"
        assert (site / "vllm").is_dir()
    proc = subprocess.run(
        [sys.executable, str(INSTALLER), *vllm_sites],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(vllm_sites)
    assert all(line.endswith("(cached)") for line in lines), lines


def test_site_for_refuses_an_unknown_install(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOLICY_VLLM_CACHE", str(tmp_path))
    (tmp_path / "0.34.0" / "site").mkdir(parents=True)  # no COMPLETE: a killed install
    with pytest.raises(install_vllm.InstallError, match="not installed"):
        install_vllm.site_for("0.34.0")


def test_site_for_refuses_an_install_made_with_other_pins(tmp_path, monkeypatch):
    """A cache kept between CI runs installs again when a pin changes (a stale site once
    let anyio import an old typing_extensions from the test interpreter)."""
    monkeypatch.setenv("KVPOLICY_VLLM_CACHE", str(tmp_path))
    (tmp_path / "0.34.0" / "site").mkdir(parents=True)
    marker = tmp_path / "0.34.0" / "COMPLETE"
    marker.write_text(install_vllm._complete_text("0.34.0"))
    assert install_vllm.site_for("0.34.0") == tmp_path / "0.34.0" / "site"
    marker.write_text(install_vllm._complete_text("0.34.0").replace("typing-extensions==4.16.0\n", ""))
    with pytest.raises(install_vllm.InstallError, match="other pins"):
        install_vllm.site_for("0.34.0")


# Requirements of the site's packages that the interpreter is trusted to meet: the
# project's own CPU torch stands in for vLLM's CUDA pin on purpose (install_vllm.py).
_FROM_THE_INTERPRETER = {"torch"}


def test_every_package_the_site_leaves_to_the_interpreter_meets_its_requirement(vllm_sites):
    """The oracles run with the release site in front of the interpreter's own site-packages,
    so a requirement the site does not pin is met by whatever the interpreter has: on a CI
    machine whose system Python had typing_extensions 4.15, anyio 4.16 (which needs 4.16)
    failed to import and 960 decisions became ImportErrors. Each such requirement must be
    pinned in the site, or met by the interpreter's version."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    unmet = []
    for version, site in vllm_sites.items():
        pinned = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])}
        outside = [p for p in sys.path if p and Path(p).resolve() != site.resolve()]
        interpreter = {}
        for dist in metadata.distributions(path=outside):
            interpreter.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
        for name, dist in sorted(pinned.items()):
            for line in dist.requires or []:
                req = Requirement(line)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                dep = canonicalize_name(req.name)
                have = pinned.get(dep) or interpreter.get(dep)
                if have is None or dep in _FROM_THE_INTERPRETER:
                    continue  # not installed: the oracles never import it (install_vllm.py)
                if not req.specifier.contains(have.version, prereleases=True):
                    where = "the site" if dep in pinned else "the interpreter"
                    unmet.append(f"vLLM {version}: {name} needs {req}, {where} has {dep} {have.version}")
    assert not unmet, "pin these in install_vllm.PINNED:\n" + "\n".join(unmet)


def test_v034_oracle_facts_and_a_decision(vllm_sites):
    facts, decision, rejected = run_oracle(
        "0.34.0",
        "v034",
        [
            {"facts": True},
            {
                "workers": [["FLASH_ATTN"]],
                "device_capability": [9, 0],
                "specs": [{"kind": "full", "num_kv_heads": 8, "head_size": 128, "block_size": 16}],
                "VLLM_KV_CACHE_LAYOUT": None,
                "kv_transfer_config": None,
            },
            {
                "workers": [["FLEX_ATTENTION"]],
                "device_capability": [9, 0],
                "specs": [{"kind": "full"}],
                "VLLM_KV_CACHE_LAYOUT": "HND",
                "kv_transfer_config": None,
            },
        ],
    )
    assert facts["version"] == "0.34.0"
    assert set(facts["layouts"]) == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    assert "fp8_per_token_head" in facts["kv_cache_dtypes"]
    assert facts["connectors"]["OffloadingConnector"]["get_required_kvcache_layout"]["default"] == "LBHNC"
    assert decision["layout"] in facts["layouts"]
    assert rejected["error"].startswith("ValueError: VLLM_KV_CACHE_LAYOUT=HND")


def test_v034_oracle_geometry_places_per_token_head_scales(vllm_sites):
    (geo,) = run_oracle(
        "0.34.0",
        "v034",
        [
            {
                "backend": "TRITON_ATTN",
                "kv_cache_dtype": "fp8_per_token_head",
                "layout": "BLHNC",
                "num_layers": 3,
                "num_blocks": 5,
                "num_kv_heads": 2,
                "head_size": 64,
                "block_size": 16,
                "dtype": "bfloat16",
            }
        ],
    )
    assert geo["spec"]["page_size_bytes"] == 2 * 16 * 2 * (64 + 4) == 4352
    offsets = [layer["byte_offset"] for layer in geo["layers"]]
    assert offsets == [0, 4352, 8704]
    assert all(layer["byte_strides"][0] == 3 * 4352 for layer in geo["layers"])
    assert geo["layers"][0]["k_scale_byte_offset_in_cell"] == 64


def test_v028_oracle_facts(vllm_sites):
    (facts,) = run_oracle("0.28.0", "v028", [{"facts": True}])
    assert facts["vllm_version"] == "0.28.0"
    triton = facts["backends"]["TRITON_ATTN"]["by_layout"]
    assert triton["HND"]["stride_order_with_layers"] == [1, 2, 0, 3, 4]
    assert triton["NHD"]["stride_order_with_layers"] == [1, 0, 3, 2, 4]


def test_oracle_answers_are_kept_per_machine_and_asked_again_when_an_input_changes(vllm_sites, monkeypatch):
    import vllm_release

    cases = [{"mla": False, "major": 9}]
    first = run_oracle("0.34.0", "backend_priority", cases)
    kept = vllm_release.answers_file("0.34.0", "backend_priority", cases)
    assert kept is not None and kept.is_file()

    def never(*_args, **_kwargs):
        raise AssertionError("the release was asked again")

    monkeypatch.setattr(vllm_release, "_ask", never)
    assert run_oracle("0.34.0", "backend_priority", cases) == first  # reused
    other = [{"mla": True, "major": 9}]
    assert vllm_release.answers_file("0.34.0", "backend_priority", other) != kept
    with pytest.raises(AssertionError, match="asked again"):
        run_oracle("0.34.0", "backend_priority", other)  # other cases: asked
    monkeypatch.setenv("KVPOLICY_UNPATCHED_INTERPRETER", "1")  # a variable an oracle reads: another key
    assert vllm_release.answers_file("0.34.0", "backend_priority", cases) != kept
    monkeypatch.setenv("KVPOLICY_ORACLE_CACHE", "0")
    with pytest.raises(AssertionError, match="asked again"):
        run_oracle("0.34.0", "backend_priority", cases)


def test_no_oracle_module_shadows_a_module_vllm_imports(vllm_sites):
    """An oracle runs as a script, so its directory is first on ``sys.path``: an oracle named like a
    module vLLM imports (vLLM 0.34 tries ``import triton_kernels``, an optional package) would be
    imported in its place by every oracle, and run its module-level code there. No oracle (nor a
    helper beside them) may carry the name of a top-level module any installed release imports."""
    import re

    names = {p.stem for p in (Path(__file__).parent / "oracles").glob("*.py")}
    pattern = re.compile(r"^\s*(?:import|from)\s+(" + "|".join(sorted(names)) + r")\b", re.MULTILINE)
    clashes = set()
    for version, site in vllm_sites.items():
        for source in (site / "vllm").rglob("*.py"):
            for match in pattern.finditer(source.read_text(encoding="utf-8", errors="replace")):
                clashes.add((match[1], version, str(source.relative_to(site))))
    assert not clashes, sorted(clashes)[:10]


def test_one_answer_is_asked_once_among_processes_sharing_the_cache(tmp_path):
    """pytest -n: every worker starts the same oracles ahead; the first asks, the others wait for it and
    read what it kept, and a stale answer of older code is removed once the new one is kept."""
    import threading
    import time

    import answer_cache

    kept = tmp_path / "answers" / "oracle-newcode-cases.json"
    stale = tmp_path / "answers" / "oracle-oldcode-cases.json"
    stale.parent.mkdir()
    stale.write_text("[1]")
    cases = [{"case": 1}, {"case": 2}]
    asked: list[int] = []
    entered = threading.Event()

    def ask() -> list[dict]:
        asked.append(1)
        entered.set()
        time.sleep(0.3)  # long enough that the second asker arrives while this one holds the answer
        return [{"answer": 1}, {"answer": 2}]

    results: list[tuple[list[dict], bool]] = []
    first = threading.Thread(target=lambda: results.append(answer_cache.answered(kept, cases, ask)))
    first.start()
    assert entered.wait(10)
    second = answer_cache.answered(kept, cases, ask)  # opens the lock file anew: another lock holder
    first.join()
    assert len(asked) == 1
    assert results == [([{"answer": 1}, {"answer": 2}], True)]
    assert second == ([{"answer": 1}, {"answer": 2}], False)
    assert not stale.exists()
    assert answer_cache.answered(kept, [{"case": 1}], ask)[1] is True  # a cut-short file is asked again
