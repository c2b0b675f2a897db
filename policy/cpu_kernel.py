"""The CPU attention kernel's write order, as data: which ISA vLLM's CPU_ATTN writes a block with.

vLLM's CPU attention backend writes the KV cache with one compiled op
(``cpu_attn_reshape_and_cache``) whose order of a block's elements is the
ISA's: ``vec`` and ``vec16`` store each head's K (and V) rows dim-major
inside a block, ``amx`` interleaves pairs of elements VNNI-style. Which ISA
runs is decided per attention group by ``_get_attn_isa``
(``vllm/v1/attention/backends/cpu_attn.py``) from the model dtype, the block
size, the head size, the KV cache dtype and the host CPU. The same K and V
therefore land in other bytes on a host with AMX tiles than on one without,
and a block written on one is garbage on the other, with nothing crashing.

A release states ``_get_attn_isa`` as a list of `IsaRule`s (its profile's
``CPU_ATTN.write_isa``), the first that matches naming the ISA or vLLM's
refusal; `CpuHost` is what the rules read of the CPU, this machine's by
default (`CpuHost.this_host`) or another host's (`CpuHost.parse`). Worked
example, vLLM 0.32, a bfloat16 model, block 32, head 64: ``amx`` on a Sapphire
Rapids host (``x86+avx512+amx``), ``vec`` on this kind of AVX2 host (``x86``).

Pure Python, no torch.
"""

from __future__ import annotations

import functools
import platform
from enum import Enum
from pathlib import Path

from pydantic import Field

from kvpolicy.policy.errors import input_error
from kvpolicy.policy.spec import Frozen

__all__ = ["CpuArch", "CpuHost", "IsaRule", "pick_isa", "pick_order"]


class CpuArch(str, Enum):
    """vLLM's ``CpuArchEnum`` as `_get_attn_isa` tells them apart."""

    x86 = "x86"
    arm = "arm"
    power = "power"
    s390x = "s390x"
    riscv = "riscv"

    def __str__(self) -> str:
        return self.value


_MACHINES = {"x86_64": CpuArch.x86, "amd64": CpuArch.x86, "i686": CpuArch.x86, "aarch64": CpuArch.arm,
             "arm64": CpuArch.arm, "ppc64le": CpuArch.power, "ppc64": CpuArch.power, "s390x": CpuArch.s390x,
             "riscv64": CpuArch.riscv}
_FEATURES = ("avx512", "amx", "rvv")


class CpuHost(Frozen):
    """What `_get_attn_isa` reads of the host CPU: the architecture and the x86 features it tests.

    Written as a label: the architecture, then ``+feature`` for each it has:
    ``x86`` (AVX2 only), ``x86+avx512``, ``x86+avx512+amx``, ``arm``, ``riscv+rvv``.
    """

    arch: CpuArch = CpuArch.x86
    avx512: bool = Field(default=False, description="AVX-512 (`torch.cpu._is_avx512_supported`)")
    amx: bool = Field(default=False, description="AMX tiles usable (`torch.cpu._is_amx_tile_supported`)")
    rvv: bool = Field(default=False, description="RISC-V vector extension (`_riscv_supports_rvv`)")

    @property
    def label(self) -> str:
        return "+".join([self.arch.value, *(f for f in _FEATURES if getattr(self, f))])

    def has(self, feature: str) -> bool:
        """A feature (``amx``, ``avx512``, ``rvv``) or an architecture name (``arm``, ``x86``...)."""
        return self.arch.value == feature if feature in CpuArch.__members__ else bool(getattr(self, feature))

    @classmethod
    def parse(cls, text: str, where: str = "cpu") -> CpuHost:
        """A label (``x86+avx512+amx``); an `InputError` located at ``where`` naming what it takes."""
        arch, *features = [part.strip().lower() for part in str(text).split("+")]
        help = ("write the architecture, then `+feature` for each it has: x86 (an AVX2 host: vLLM tests AVX-512 and "
                "AMX only), x86+avx512, x86+avx512+amx, arm, power, s390x, riscv, riscv+rvv")
        if arch not in CpuArch.__members__:
            raise input_error(where, f"unknown CPU architecture `{arch[:40]}`", help, code="unknown-cpu")
        unknown = [f for f in features if f not in _FEATURES]
        if unknown:
            raise input_error(where, f"unknown CPU feature `{unknown[0][:40]}`", help, code="unknown-cpu")
        host = cls(arch=CpuArch(arch), **{f: True for f in features})
        if host.arch is not CpuArch.x86 and (host.avx512 or host.amx):
            raise input_error(where, "AVX-512 and AMX are x86 features", help, code="unknown-cpu")
        if host.rvv and host.arch is not CpuArch.riscv:
            raise input_error(where, "`rvv` is a RISC-V feature", help, code="unknown-cpu")
        return host

    @classmethod
    def this_host(cls) -> CpuHost:
        """This machine's CPU, read from ``/proc/cpuinfo``'s flags (``avx512f``, ``amx_tile``) and the
        machine name; where there is no ``/proc/cpuinfo``, the architecture alone."""
        return _this_host()


@functools.cache
def _this_host() -> CpuHost:
    arch = _MACHINES.get(platform.machine().lower(), CpuArch.x86)
    flags: set[str] = set()
    try:
        with Path("/proc/cpuinfo").open(encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "isa", "features")):  # x86 "flags", riscv "isa", arm "Features"
                    flags.update(line.partition(":")[2].split())
                    break
    except OSError:
        pass
    x86 = arch is CpuArch.x86
    return CpuHost(arch=arch, avx512=x86 and "avx512f" in flags, amx=x86 and "amx_tile" in flags,
                   rvv=arch is CpuArch.riscv and any(f.startswith("rv64") and "v" in f[4:] for f in flags))


class IsaRule(Frozen):
    """One step of `_get_attn_isa`: when every condition given holds, the ISA (or vLLM's refusal).

    ``host`` and ``host_lacks`` name `CpuHost` features or architectures; ``quantized``
    is whether the KV cache dtype is an fp8 one (vLLM's ``is_quantized_kv_cache``).
    """

    isa: str | None = Field(default=None, description="the ISA the kernel writes with")
    order: str | None = Field(default=None, description="the byte order this ISA's write gives a block, where it "
                              "is another ISA's (vec16 writes vec's); None: its own, named as the ISA")
    refuse: str | None = Field(default=None, description="vLLM's error (NotImplementedError) instead of an ISA")
    write_refuses: str | None = Field(default=None, description="the compiled op's error when it writes with this "
                                      "ISA: `_get_attn_isa` picks it, vLLM starts, and the first cache write fails")
    host: str | None = None
    host_lacks: tuple[str, ...] = ()
    dtypes: tuple[str, ...] | None = None
    block_multiple_of: int | None = None
    head_size_multiple_of: int | None = None
    head_size_not_multiple_of: int | None = None
    quantized: bool | None = None

    def matches(self, dtype: str, block_size: int, head_size: int, quantized: bool, host: CpuHost) -> bool:
        return ((self.host is None or host.has(self.host))
                and not any(host.has(f) for f in self.host_lacks)
                and (self.dtypes is None or dtype in self.dtypes)
                and (self.block_multiple_of is None or block_size % self.block_multiple_of == 0)
                and (self.head_size_multiple_of is None or head_size % self.head_size_multiple_of == 0)
                and (self.head_size_not_multiple_of is None or head_size % self.head_size_not_multiple_of != 0)
                and (self.quantized is None or quantized == self.quantized))


def pick_isa(rules: tuple[IsaRule, ...], *, dtype: str, block_size: int, head_size: int, kv_cache_dtype: str,
             host: CpuHost) -> str:
    """The ISA ``rules`` (a release's `_get_attn_isa`) pick; an `InputError` (``cpu-kernel-refuses``)
    where vLLM refuses the combination, in its words."""
    return _pick(rules, dtype, block_size, head_size, kv_cache_dtype, host).isa or ""


def pick_order(rules: tuple[IsaRule, ...], *, dtype: str, block_size: int, head_size: int, kv_cache_dtype: str,
               host: CpuHost) -> str:
    """The byte order of the ISA ``rules`` pick (`IsaRule.order`, else the ISA's name): what the
    fingerprint's ``kernel_order`` says, equal for two ISAs exactly when they write the same bytes."""
    rule = _pick(rules, dtype, block_size, head_size, kv_cache_dtype, host)
    if rule.write_refuses is not None:
        raise input_error("kv_cache_dtype", f"vLLM's CPU attention picks the `{rule.isa}` kernel for this cache on a "
                          f"`{host.label}` host, and that kernel refuses to write it: \"{rule.write_refuses}\" (vLLM "
                          "starts, then fails at the first write)", "use a block size that is a multiple of 32, or "
                          "another kv_cache_dtype", code="cpu-kernel-refuses")
    return rule.order or rule.isa or ""


def _pick(rules: tuple[IsaRule, ...], dtype: str, block_size: int, head_size: int, kv_cache_dtype: str,
          host: CpuHost) -> IsaRule:
    quantized = kv_cache_dtype.startswith("fp8")
    for rule in rules:
        if rule.matches(dtype, block_size, head_size, quantized, host):
            if rule.refuse is not None:
                raise input_error("kv_cache_dtype", f"vLLM's CPU attention refuses this cache on a `{host.label}` "
                                  f"host: \"{rule.refuse}\"", "decide for a host that has what it asks "
                                  "(`--cpu`), or another kv_cache_dtype", code="cpu-kernel-refuses")
            assert rule.isa is not None
            return rule
    raise input_error("kv_cache_dtype", f"the release's `_get_attn_isa` picks no ISA for dtype {dtype}, block "
                      f"{block_size}, head {head_size} on `{host.label}`", "report this: a profile's rules must "
                      "end in a rule without conditions", code="cpu-kernel-refuses")
