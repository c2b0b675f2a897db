"""Install released vLLM wheels, next to the project's CPU torch, for the conformance tests.

    python3 tests/conformance/install_vllm.py 0.34.0 0.28.0 triton

Each release goes to ``$KVPOLICY_VLLM_CACHE`` (default ``~/.cache/kvpolicy/vllm``)
``/<version>/site`` and is reused while ``<version>/COMPLETE`` holds exactly what this
file would install now (the pinned list and the Python version); COMPLETE is written
last, so a killed install or an edited pin list installs again. vLLM itself is installed with
``--no-deps``: pip never resolves its requirements (they pull a CUDA torch). The
oracles run with the running interpreter's torch and only the small packages that the
vLLM modules they import need, pinned per release below. Stdlib only.

Triton (``TRITON_VERSION``) goes to its own ``triton-<version>/site`` in the same
cache, shared by the releases: the kernel oracle (``oracles/quantized_cells.py``) puts
it after the release's site and runs vLLM's Triton kernels on the CPU with
``TRITON_INTERPRET=1``. It is kept out of the release sites so that the decision
and geometry oracles keep running without Triton, as they always have.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: installers of one process still take turns
    fcntl = None  # type: ignore[assignment]

# The packages that the oracles' vLLM imports need, found by importing and iterating
# (vllm.config, v1.attention.backends.*, v1.kv_cache_interface, the KV connector
# factory and every registered connector the oracles load). Versions are the newest
# that each release's own requirements accept (fastapi < 0.137, transformers < 5.23
# for 0.34). Not installed, on purpose: flashinfer (CUDA JIT package; the oracle
# gives the FLASHINFER backend module a stand-in), nixl, mooncake, lmcache (their
# connectors import them lazily or inside try/except). triton is not in the release
# sites (vLLM's triton_utils has a CPU placeholder there); the kernel oracle adds
# the separate Triton site below.
_COMMON = [
    "aiohappyeyeballs==2.7.1",
    "aiohttp==3.14.5",
    "aiosignal==1.4.0",
    "annotated-doc==0.0.7",
    "anyio==4.16.0",
    "apache-tvm-ffi==0.1.11",
    "attrs==26.1.0",
    "cachetools==8.0.2",
    "cbor2==6.3.0",
    "certifi==2026.10.19.post1",
    "click==8.5.1",
    "cloudpickle==3.1.3",
    "einops==0.8.2",
    "fastapi==0.136.3",
    "frozenlist==1.8.0",
    "h11==0.16.0",
    "httpcore2==2.16.2",
    "httpx2==2.16.2",
    "huggingface-hub==2.4.0",
    "idna==3.20",
    "llguidance==1.7.6",
    "msgspec==0.23.0",
    "multidict==7.2.1",
    "numpy==2.4.6",
    "orjson==3.13.0",
    "pillow==13.0.0",
    "prometheus-client==0.26.0",
    "propcache==0.5.4",
    "psutil==7.2.2",
    "py-cpuinfo==9.0.0",
    "pybase64==1.5.1",
    "pyzmq==27.3.0",
    "regex==2026.11.19",
    "requests==2.34.2",
    "safetensors==0.8.0",
    "starlette==1.10.0",
    "tokenizers==0.23.3",
    "tqdm==4.70.1",
    "transformers==5.22.2",
    "truststore==0.10.5",
    # anyio 4.16 imports typing_extensions.sentinel (4.16+); without its own copy the
    # site would use whatever older typing_extensions the test interpreter has.
    "typing-extensions==4.16.0",
    "urllib3==2.8.0",
    "uvicorn==0.55.0",
    "uvloop==0.23.0",
    "xgrammar==0.2.8",
    "yarl==1.25.1",
]

def _pin(pins: list[str], pin: str) -> list[str]:
    """``pins`` with ``pin`` in place of the same package's pin."""
    name = pin.split("==")[0]
    return [pin if p.split("==")[0] == name else p for p in pins]


_OPENAI = [
    "httpcore==1.0.9",
    "httpx==0.29.0",
    "openai==3.57.0",
    "openai-harmony==0.0.8",
    "sniffio==1.3.1",
]

_GATE = [*_COMMON, *_OPENAI]

PINNED: dict[str, list[str]] = {
    "0.34.0": list(_COMMON),
    # 0.29-0.33, like 0.28, import openai / openai_harmony at module level, and their tool parsers
    # (which the entrypoint modules that VllmConfig reaches import) partial_json_parser.
    **{version: [*_COMMON, *_OPENAI, "partial-json-parser==0.2.1.1.post7"] for version in ("0.30.0", "0.29.0")},
    # each release's own bounds (test_harness checks every requirement of every package in a site)
    "0.33.0": _pin([*_COMMON, *_OPENAI, "partial-json-parser==0.2.1.1.post7"], "transformers==5.20.2"),
    "0.32.0": _pin([*_COMMON, *_OPENAI, "partial-json-parser==0.2.1.1.post7"], "transformers==5.19.0"),
    "0.31.0": _pin(_pin(_pin([*_COMMON, *_OPENAI, "partial-json-parser==0.2.1.1.post7"], "transformers==5.17.0"),
                        "xgrammar==0.2.7"), "huggingface-hub==1.33.0"),
    # 0.24-0.28 also import openai / openai_harmony at module level (entrypoint types that
    # their config and worker modules reach), and their MooncakeConnector imports httpx. Each
    # of 0.24.0, 0.25.0/0.25.1, 0.26.0, 0.27.0/0.27.1 was installed with this list and runs every
    # gate oracle (facts, gate, geometry, plugin) with it: none needs a package more.
    # apache-tvm-ffi: each release pins its own (0.24-0.25: 0.1.9, 0.26: 0.1.10; 0.27 on: 0.1.11), and
    # xgrammar 0.2.8 needs 0.1.11: the newest xgrammar that takes the older one (and transformers 5).
    **{v: _pin(_pin(_GATE, "apache-tvm-ffi==0.1.9"), "xgrammar==0.2.3") for v in ("0.24.0", "0.25.0", "0.25.1")},
    "0.26.0": _pin(_pin(_GATE, "apache-tvm-ffi==0.1.10"), "xgrammar==0.2.7"),
    **{v: list(_GATE) for v in ("0.27.0", "0.27.1", "0.28.0")},
}


# The Triton whose interpreter runs vLLM 0.34.0's kernels: the newest release, which is
# the one torch 2.14.0 (vLLM 0.34.0's pin) is built against. Only its interpreter and
# `triton.language` are used; a ~290 MB wheel, downloaded once into the cache.
TRITON_VERSION = "3.9.0"


class InstallError(RuntimeError):
    """An install step failed; the message says which and why."""


def cache_root() -> Path:
    env = os.environ.get("KVPOLICY_VLLM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvpolicy" / "vllm"


def _complete_marker(version: str) -> Path:
    return cache_root() / version / "COMPLETE"


def _complete_text(version: str) -> str:
    """What COMPLETE holds for an install of ``version`` made by this file under this Python."""
    return f"vllm=={version}\npython {sys.version.split()[0]}\n" + "\n".join(PINNED[version]) + "\n"


def site_for(version: str) -> Path:
    """The installed site of a release; raises InstallError if it is not installed or stale."""
    site = cache_root() / version / "site"
    marker = _complete_marker(version)
    if not marker.is_file() or not site.is_dir():
        raise InstallError(
            f"vLLM {version} is not installed under {cache_root()}; run "
            f"`python3 tests/conformance/install_vllm.py {version}`"
        )
    if version in PINNED and marker.read_text() != _complete_text(version):
        raise InstallError(
            f"vLLM {version} under {cache_root()} was installed with other pins or another "
            f"Python; run `python3 tests/conformance/install_vllm.py {version}` to reinstall"
        )
    return site


def publish_site(staged: Path, root: Path) -> Path:
    """Byte-compile a staged site and move it to ``root/site`` (replacing an older one); the caller
    writes COMPLETE after, so a killed install is never taken for a finished one. Byte-compiled once
    because the tests run with PYTHONDONTWRITEBYTECODE, and vLLM plus transformers take many seconds
    to compile on every import otherwise; a vendored file that does not compile under this Python is
    not fatal."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j0", str(staged)], capture_output=True)
    final = root / "site"
    if final.exists():
        shutil.rmtree(final)
    staged.rename(final)
    return final


def _pip(*args: str, log: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    log.append(" ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise InstallError(f"pip failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")


def _install(version: str) -> Path:
    if version not in PINNED:
        raise InstallError(f"no pinned dependency list for vLLM {version}; known: {sorted(PINNED)}")
    root = cache_root() / version
    root.mkdir(parents=True, exist_ok=True)
    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix=".install-", dir=root) as tmp:
        tmp_path = Path(tmp)
        wheels = tmp_path / "wheels"
        site = tmp_path / "site"
        _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), f"vllm=={version}", log=log)
        vllm_wheels = sorted(wheels.glob("vllm-*.whl"))
        if len(vllm_wheels) != 1:
            raise InstallError(f"expected one vllm wheel, got {vllm_wheels}")
        _pip("install", "--no-deps", "--no-compile", "--target", str(site), str(vllm_wheels[0]), log=log)
        _pip(
            "install",
            "--no-deps",
            "--no-compile",
            "--only-binary=:all:",
            "--target",
            str(site),
            *PINNED[version],
            log=log,
        )
        if (site / "torch").exists():
            raise InstallError(f"{site} must not contain torch")
        publish_site(site, root)
    _complete_marker(version).write_text(_complete_text(version))
    return root / "site"


_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _installing(name: str) -> Iterator[None]:
    """One installer at a time for a cache entry: among this process's threads (the tests' oracles run
    ahead in a pool) and among processes sharing the cache (an advisory lock file)."""
    with _THREAD_LOCKS_GUARD:
        lock = _THREAD_LOCKS.setdefault(name, threading.Lock())
    with lock:
        cache_root().mkdir(parents=True, exist_ok=True)
        with open(cache_root() / f".{name}.lock", "w") as handle:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_EX)
            yield


def _ensure(name: str, installed: Callable[[], Path], install: Callable[[], Path]) -> Path:
    try:
        return installed()
    except InstallError:
        with _installing(name):
            try:
                return installed()  # another installer finished while this one waited
            except InstallError:
                return install()


def ensure(version: str) -> Path:
    """The installed site of a release, installing it first if needed."""
    return _ensure(version, lambda: site_for(version), lambda: _install(version))


def triton_site() -> Path:
    """The installed Triton site; raises InstallError if it is not installed."""
    root = cache_root() / f"triton-{TRITON_VERSION}"
    if not (root / "COMPLETE").is_file() or not (root / "site" / "triton").is_dir():
        raise InstallError(
            f"triton {TRITON_VERSION} is not installed under {cache_root()}; run "
            f"`python3 tests/conformance/install_vllm.py triton`"
        )
    return root / "site"


def _install_triton() -> Path:
    root = cache_root() / f"triton-{TRITON_VERSION}"
    root.mkdir(parents=True, exist_ok=True)
    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix=".install-", dir=root) as tmp:
        site = Path(tmp) / "site"
        _pip("install", "--no-deps", "--no-compile", "--only-binary=:all:", "--target", str(site),
             f"triton=={TRITON_VERSION}", log=log)
        if not (site / "triton").is_dir() or (site / "torch").exists():
            raise InstallError(f"{site}: expected triton alone, got {sorted(p.name for p in site.iterdir())}")
        publish_site(site, root)
    (root / "COMPLETE").write_text(f"triton=={TRITON_VERSION}\npython {sys.version.split()[0]}\n")
    return root / "site"


def ensure_triton() -> Path:
    """The installed Triton site, installing it first if needed."""
    return _ensure(f"triton-{TRITON_VERSION}", triton_site, _install_triton)


def ensure_verbose(version: str) -> tuple[Path, str]:
    try:
        return (triton_site() if version == "triton" else site_for(version)), "cached"
    except InstallError:
        start = time.monotonic()
        site = ensure_triton() if version == "triton" else ensure(version)
        return site, f"installed in {time.monotonic() - start:.0f} s"


def main(argv: list[str]) -> int:
    versions = argv or [*sorted(PINNED), "triton"]
    for version in versions:
        try:
            site, how = ensure_verbose(version)
        except InstallError as exc:
            print(f"install_vllm: {version}: {exc}", file=sys.stderr)
            return 1
        print(f"{version} {site} ({how})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
