"""The one machine every oracle answers for, whatever machine runs the suite.

vLLM reads the host while it builds what the oracles ask about, and the answer then follows the
machine: on an AMD EPYC (AVX-512, no AMX) 0.28's and 0.34's gpt-oss MXFP4 experts find no MoE kernel
(``CPUExpertsMxfp4._supports_current_device``: x86 *and* ``torch.cpu._is_amx_tile_supported()``) and
the model is not built, where an Intel Xeon with AMX builds it. So an oracle that builds vLLM objects
calls `pin_host` before vLLM reads anything, and answers for `HOST`, an x86-64 Linux machine with the
ISA below and none of the optional packages vLLM probes for. What of the host vLLM reads (0.24-0.34)
and what pins it:

- the CPU's ISA: ``torch.cpu._is_amx_tile_supported``, ``_is_amx_fp16_supported``,
  ``_is_avx512_supported``, ``_is_avx512_bf16_supported``, ``_is_vnni_supported``, ``_is_avx2_supported``
  (MoE and linear kernel choice, CPU_ATTN's fp8 support, which compiled extension
  ``CpuPlatform.import_kernels`` loads, the Mamba state dtype) and ``torch.cpu.get_capabilities``:
  each answers `HOST`'s value; ``torch.cuda.is_available`` / ``device_count``: no CUDA device;
- the architecture: ``Platform.get_cpu_architecture`` reads ``platform.machine()`` (ARM/POWER kernels,
  activation ops), and the CPU platform ``platform.system()``: they answer x86_64 / Linux;
- ``/proc/cpuinfo``, read by vLLM's own code (0.34's ``_is_amd_zen_cpu`` picks ``ZenCpuPlatform``
  when zentorch imports; RISC-V's vector length): ``open`` serves `HOST`'s text for that path;
- optional packages: vLLM takes other platforms and kernels when one imports (zentorch,
  intel_extension_for_pytorch, triton_kernels, deep_gemm, flashinfer...; its ``_has_module`` probes),
  transformers other code paths. The release sites hold none of them (`install_vllm.py`), but the
  interpreter running an oracle adds its own environment's site-packages after the site: from there only
  `FROM_ENVIRONMENT` imports, anything else is absent as on a machine with the release site alone
  (``import`` raises ModuleNotFoundError, ``importlib.util.find_spec`` answers None). An oracle's own
  stand-ins (`_common.stub_package`, model_config's stub trees) still serve theirs.

Environment variables are pinned by the harness (`vllm_release.oracle_env`: the child gets only the
variables it names). ``tests/conformance/test_host_pins.py`` runs oracles under simulated hosts both ways
(every ISA query true / false, ARM / x86, AMD / Intel cpuinfo, fake optional packages importable) and
asserts the answers are the same.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import os
import platform
import sys

# An Intel Xeon with AVX-512 (BF16, VNNI) and AMX (BF16, INT8; no AMX-FP16), as the project's development and CI
# machines are: the answers the suite was written against.
HOST = {
    "machine": "x86_64",
    "system": "Linux",
    "isa": {"amx_tile": True, "amx_fp16": False, "avx512": True, "avx512_bf16": True, "vnni": True, "avx2": True},
    "capabilities": {"architecture": "x86_64", "avx2": True, "avx512_f": True, "avx512_bf16": True,
                     "avx512_vnni": True, "amx_tile": True, "amx_bf16": True, "amx_int8": True, "amx_fp16": False},
    "cpuinfo": "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
               "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma avx512f avx512dq avx512cd avx512bw "
               "avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n\n",
}

# What an oracle may import from the environment running it (its site-packages, after the release's
# site on the path): torch and what torch, pydantic and PyYAML (which the release sites leave to it) need.
# Anything else installed there (triton, triton_kernels, zentorch, intel_extension_for_pytorch,
# torchvision, flashinfer, scipy...) is absent, as on a machine with the release site alone: vLLM and
# transformers take other platforms, kernels and code paths when one of those imports.
FROM_ENVIRONMENT = frozenset({
    "torch", "torchgen", "functorch", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock",
    "fsspec", "typing_extensions", "pydantic", "pydantic_core", "annotated_types", "typing_inspection",
    "yaml", "_yaml", "packaging", "setuptools", "pkg_resources", "_distutils_hack", "jaraco",
    "more_itertools", "backports", "zipp", "importlib_metadata", "platformdirs",
})


def _environment_dirs() -> tuple[str, ...]:
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


class _EnvironmentFilter:
    """``sys.meta_path``'s PathFinder, answering None for a top-level module found in the running
    environment's site-packages unless it is one of `FROM_ENVIRONMENT` (or ``allow``)."""

    def __init__(self, finder, allowed: frozenset[str]):
        self.finder = finder
        self.allowed = allowed
        self.dirs = _environment_dirs()

    def find_spec(self, fullname, path=None, target=None):
        spec = self.finder.find_spec(fullname, path, target)
        if spec is None or path is not None or fullname in self.allowed:
            return spec
        places = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
        if any(os.path.realpath(p).startswith(self.dirs) for p in places if p):
            return None
        return spec

    def invalidate_caches(self):
        return self.finder.invalidate_caches()

    def __getattr__(self, name):
        return getattr(self.finder, name)


def pin_host(allow: tuple[str, ...] = ()) -> None:
    """Answer for `HOST` from now on; ``allow`` names more top-level modules the oracle may take from
    the running environment. Call before vLLM is imported: some reads are made at import."""
    import torch

    for name, value in HOST["isa"].items():
        setattr(torch.cpu, f"_is_{name}_supported", lambda value=value: value)
    torch.cpu.get_capabilities = lambda: dict(HOST["capabilities"])
    torch.cuda.is_available = lambda: False  # the CPU torch the harness runs: no CUDA device, whatever the machine has
    torch.cuda.device_count = lambda: 0
    platform.machine = lambda: HOST["machine"]
    platform.system = lambda: HOST["system"]

    if not getattr(builtins.open, "_pinned_cpuinfo", False):
        real_open = builtins.open

        def pinned_open(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and os.fspath(file) == "/proc/cpuinfo":
                import io

                mode = args[0] if args else kwargs.get("mode", "r")
                return io.BytesIO(HOST["cpuinfo"].encode()) if "b" in mode else io.StringIO(HOST["cpuinfo"])
            return real_open(file, *args, **kwargs)

        pinned_open._pinned_cpuinfo = True
        builtins.open = pinned_open
        real_exists = os.path.exists
        os.path.exists = lambda path: path == "/proc/cpuinfo" or real_exists(path)

    allowed = FROM_ENVIRONMENT | set(allow)
    for i, finder in enumerate(sys.meta_path):
        if finder is importlib.machinery.PathFinder:
            sys.meta_path[i] = _EnvironmentFilter(finder, allowed)
        elif isinstance(finder, _EnvironmentFilter):
            finder.allowed = allowed
