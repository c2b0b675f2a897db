"""The installed package (not the source tree) finds its shipped rules and runs the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, f"cannot build a wheel: {proc.stderr.strip()[-300:]}"
    return next(out.glob("kvpolicy-*.whl"))


def test_wheel_ships_every_rule_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [*ROOT.glob("rules/*/*.yaml"), *ROOT.glob("rules/*/connectors/*.yaml"),
               *ROOT.glob("rules/*/tests/*.yaml")]
    assert len(shipped) >= 17
    for path in shipped:
        assert "kvpolicy/rules/" + str(path.relative_to(ROOT / "rules")) in names, path


def test_wheel_ships_every_python_package(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    facade = sorted(p.name for p in (ROOT / "kvpolicy").glob("*.py"))
    assert facade == ["__init__.py", "__main__.py"]  # `from kvpolicy import LayoutEngine`, `python -m kvpolicy`
    for name in facade:
        assert f"kvpolicy/{name}" in names, f"kvpolicy/{name} is missing from the wheel"
    for init in [*ROOT.glob("policy/**/__init__.py"), *ROOT.glob("engine/**/__init__.py")]:
        package = Path("kvpolicy") / init.parent.relative_to(ROOT)
        for module in init.parent.glob("*.py"):
            assert str(package / module.name) in names, f"{package / module.name} is missing from the wheel"


def test_installed_package_validates_and_tests_its_rules(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = [sys.executable, "-m", "kvpolicy.engine.cli.main"]
    for argv, expect in ((["validate"], "ok: 11 rules in 6 files"), (["test"], "0 failed"),
                         (["dry-run", "--explain", "notes"], "layout: LBNHC"),
                         (["lint"], "0 error(s)"),
                         (["validate", "shipped"], "ok: 11 rules in 6 files"),  # the name works installed (issue 22)
                         (["diff", "shipped", "shipped"], "0 decision(s) change")):
        proc = subprocess.run(run + argv, capture_output=True, text=True, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        assert expect in proc.stdout
    where = subprocess.run([sys.executable, "-c", "import kvpolicy; print(kvpolicy.shipped_rules_dir())"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, check=True).stdout.strip()
    assert where == str(target / "kvpolicy" / "rules" / "issue-48412")  # the profile tests/conftest.py selects
    default = {k: v for k, v in env.items() if k != "KVPOLICY_VLLM_VERSION"}
    proc = subprocess.run([*run, "dry-run", "--explain", "notes"], capture_output=True, text=True, cwd=tmp_path,
                          env=default)
    assert proc.returncode == 0, proc.stderr
    assert "layout: LBHNC (per_layer, HND)" in proc.stdout and "rule set: rules/vllm-0.34" in proc.stdout


def test_wheel_needs_torch_only_for_its_extra(wheel: Path) -> None:
    """`pip install kvpolicy` pulls no torch; `kvpolicy[torch]` (and the test extras) do."""
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    torch = [r for r in requires if r.startswith("torch")]
    assert torch and all('extra == "torch"' in r for r in torch), torch
    assert "Provides-Extra: torch" in meta
    assert any(r.startswith("kvpolicy[torch]") and 'extra == "test"' in r for r in requires), requires


def test_wheel_ships_the_serve_argument_facts(wheel: Path, tmp_path: Path) -> None:
    """`dry-run -- <vllm serve line>` reads each release's parser facts from the installed package."""
    names = set(zipfile.ZipFile(wheel).namelist())
    facts = sorted(ROOT.glob("engine/vllm_serve_args/*.json"))
    assert len(facts) >= 11
    for path in facts:
        assert f"kvpolicy/engine/vllm_serve_args/{path.name}" in names, path
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, "-m", "kvpolicy.engine.cli.main", "dry-run", "--vllm-version", "0.28.0",
                           "--explain", "notes", "--", str(ROOT / "tests" / "e2e" / "tiny-llama"), "-tp", "2",
                           "--port", "8000"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "1 KV heads x 64" in proc.stdout
    assert "ignored, they do not bear on the KV cache layout: --port" in proc.stderr


def test_wheel_ships_the_load_bearing_guard_table(wheel: Path) -> None:
    """The vLLM plugin's start-up reads which shipped guards bear load from the package, not from a lint."""
    assert "kvpolicy/engine/analysis/guard_table.json" in set(zipfile.ZipFile(wheel).namelist())
