"""Run an oracle on a simulated machine: ``python simulated_host.py NAME ORACLE.py`` (stdin, stdout and
the environment as the oracle's own; `vllm_release.run_oracle(..., host=NAME)` calls it).

For the test of the oracles' host pins (`test_host_pins.py`): before the oracle's first line runs, the
process answers what vLLM reads of the machine as machine NAME would (`HOSTS`): the CPU's ISA queries
(``torch.cpu._is_*_supported``, ``get_capabilities``), ``torch.cuda.is_available``/``device_count``,
``platform.machine()``, ``/proc/cpuinfo``, and packages installed in the environment's site-packages
(importable inert modules: any attribute is a placeholder class). An oracle that pins the host
(`oracles/_host.py`) answers the same on every one; one that does not answers for the simulated machine,
or fails on it.
"""

from __future__ import annotations

import builtins
import io
import os
import platform
import runpy
import site
import sys
import tempfile

_EPYC_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16"
# Packages vLLM probes for and takes other platforms or kernels with (none is in a release site).
_PROBED = ("zentorch", "intel_extension_for_pytorch", "triton", "triton_kernels", "deep_gemm", "flashinfer",
           "aiter", "pynvml", "amdsmi", "torchvision", "compressed_tensors")

HOSTS: dict[str, dict] = {
    # the machine of issue 33: AVX-512 (BF16) without AMX, AMD, with AMD's zentorch installed
    "amd-epyc": {"isa": {"amx_tile": False, "amx_fp16": False, "avx512": True, "avx512_bf16": True, "vnni": True,
                         "avx2": True},
                 "machine": "x86_64", "cuda": False, "packages": ("zentorch",),
                 "cpuinfo": f"processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654\n"
                            f"flags\t\t: {_EPYC_FLAGS}\n\n"},
    # an AVX2-only Xeon: no AVX-512, no AMX (0.34's CPU_ATTN refuses fp8 there), nothing installed
    "avx2-xeon": {"isa": {"amx_tile": False, "amx_fp16": False, "avx512": False, "avx512_bf16": False, "vnni": False,
                          "avx2": True},
                  "machine": "x86_64", "cuda": False, "packages": (),
                  "cpuinfo": "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) E-2288G\n"
                             "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma\n\n"},
    # everything HOST has not: an ARM machine answering every ISA query yes, a CUDA device, every probed package
    "arm-everything": {"isa": {"amx_tile": True, "amx_fp16": True, "avx512": True, "avx512_bf16": True, "vnni": True,
                               "avx2": True},
                       "machine": "aarch64", "cuda": True, "packages": _PROBED,
                       "cpuinfo": "processor\t: 0\nCPU implementer\t: 0x41\nFeatures\t: fp asimd sve sve2 bf16\n\n"},
}

_STUB = '''
class _Placeholder:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Placeholder()

    def __getattr__(self, name):
        return _Placeholder()


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Placeholder,), {})
'''


def simulate(name: str) -> None:
    """What vLLM reads of the machine answers as machine ``name`` of `HOSTS` would, from now on."""
    host = HOSTS[name]
    import torch

    for query, value in host["isa"].items():
        setattr(torch.cpu, f"_is_{query}_supported", lambda value=value: value)
    torch.cpu.get_capabilities = lambda: {**{k: v for k, v in host["isa"].items()}, "architecture": host["machine"]}
    torch.cuda.is_available = lambda: host["cuda"]
    torch.cuda.device_count = lambda: int(host["cuda"])
    platform.machine = lambda: host["machine"]
    real_open = builtins.open

    def machine_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) == "/proc/cpuinfo":
            return io.StringIO(host["cpuinfo"])
        return real_open(file, *args, **kwargs)

    builtins.open = machine_open
    if host["packages"]:  # installed where the environment's packages are: its site-packages
        installed = tempfile.mkdtemp(prefix="kvpolicy-simulated-site-")
        for package in host["packages"]:
            os.makedirs(os.path.join(installed, package))
            with real_open(os.path.join(installed, package, "__init__.py"), "w", encoding="utf-8") as f:
                f.write(_STUB)
        sys.path.append(installed)
        environment = site.getsitepackages
        site.getsitepackages = lambda *args: [*environment(*args), installed]


if __name__ == "__main__":
    simulate(sys.argv[1])
    oracle = sys.argv[2]
    sys.argv = sys.argv[2:]
    sys.path[0] = os.path.dirname(os.path.abspath(oracle))  # as when the oracle is the script run
    runpy.run_path(oracle, run_name="__main__")
