"""Oracle: what each attention backend class of a release takes, the model dtype and the block size.

Case ``{"backends": [names], "dtypes": ["float16", ...], "block_sizes": [16, 24, ...]}`` -> one answer
per backend, ``{"supported_dtypes": [...], "supports_dtype": {dtype: bool}, "kernel_block_sizes":
[16 or {"multiple_of": 16}, ...], "supports_block_size": {size: bool}}``, or ``{"error": ...}`` where
the class does not load. Each value is the class's own: ``AttentionBackendEnum[name].get_class()``'s
``supported_dtypes``, ``supports_dtype(torch.<dtype>)``, ``get_supported_kernel_block_sizes()`` and
``supports_block_size(size)``: the checks ``validate_configuration`` makes with the served model dtype
and a user-specified ``--block-size`` (the selector passes the block size only when the user set it).

Case ``{"hma": [{"kv_connector": ..., "kv_connector_extra_config": {...}}, ...]}`` -> one bool per
config: ``KVConnectorFactory.supports_hma_config(KVTransferConfig(..., kv_role="kv_both"))``, what
``VllmConfig.__post_init__`` asks before it turns the hybrid KV cache manager off (MultiConnector:
every member; the factory imports each connector's module, instantiates none).

The current config is a default ``VllmConfig()`` (no model; 0.24's FlashAttention asks for one):
FlashAttention's FA4 head-256 page, its hybrid-Mamba fp32 sizes and FlashInfer's large Blackwell
pages, which read the model, answer their defaults. Runs under any release 0.24 on.

STAND-IN: a third-party package a backend or connector module imports at its top and the release
site lacks (flashinfer; lmcache, msgpack for LMCacheMPConnector and MoRIIOConnector) is an inert stub
module tree (``_common.stub_package``; a module-level call such as ``lmcache_init_logger(__name__).info``
answers another inert object): only the classes' own attributes and bases are read here, never a
stubbed name's behaviour.
"""

from __future__ import annotations

import json
import os
import sys

# stdout carries only the JSON answer: route everything else printed to fd 1 to stderr.
_ANSWER = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

import torch  # noqa: E402
from _host import pin_host  # noqa: E402

pin_host()  # the machine vLLM reads is _host.HOST, whatever runs this (see _host.py)


def _import_vllm_on_the_cpu_platform() -> None:
    """STAND-IN (releases before 0.28, as in v028.py): they take the CPU platform only for a build whose
    version names ``cpu``, so the ``vllm`` distribution's metadata version reads with a ``+cpu`` label
    while ``import vllm`` resolves the platform; 0.28 on pick it for VLLM_TARGET_DEVICE=cpu."""
    import importlib.metadata as md

    real = md.version
    md.version = lambda name: real(name) + "+cpu" if name == "vllm" else real(name)
    try:
        import vllm.platforms  # noqa: F401
    finally:
        md.version = real


_import_vllm_on_the_cpu_platform()
import _common  # noqa: E402
from _common import backend_class, gpu_platform_config, stub_package  # noqa: E402


def _inert_attribute(self, name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _common._Inert()


_common._Inert.__getattr__ = _inert_attribute  # STAND-IN: module-level calls on stubbed names (above)
_common._Inert.__call__ = lambda self, *args, **kwargs: _common._Inert()


def _with_stubs(load):
    """``load()``, each third-party package it misses stubbed (STAND-IN above), at most five."""
    for _ in range(5):
        try:
            return load()
        except ModuleNotFoundError as exc:
            root = (exc.name or "").split(".")[0]
            if not root or root == "vllm":
                raise
            stub_package(root)
    return load()


def _size(entry) -> int | dict:
    base = getattr(entry, "base", None)
    return {"multiple_of": int(base)} if base is not None else int(entry)


def _backend(name: str, dtypes: list[str], sizes: list[int]) -> dict:
    try:
        cls = _with_stubs(lambda: backend_class(name))
    except Exception as exc:  # a class this install cannot import says why
        return {"error": f"{type(exc).__name__}: {exc}"}
    from vllm.config import VllmConfig, set_current_vllm_config

    with gpu_platform_config():
        config = VllmConfig()
    with set_current_vllm_config(config):
        kernel_sizes = [_size(s) for s in cls.get_supported_kernel_block_sizes()]
        supports = {str(n): bool(cls.supports_block_size(n)) for n in sizes}
    return {
        "supported_dtypes": [str(d).removeprefix("torch.") for d in cls.supported_dtypes],
        "supports_dtype": {d: bool(cls.supports_dtype(getattr(torch, d))) for d in dtypes},
        "kernel_block_sizes": kernel_sizes,
        "supports_block_size": supports,
    }


def _hma(config: dict) -> bool | dict:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        ktc = KVTransferConfig(kv_connector=config["kv_connector"], kv_role="kv_both",
                               kv_connector_extra_config=config.get("kv_connector_extra_config") or {})
        return bool(_with_stubs(lambda: KVConnectorFactory.supports_hma_config(ktc)))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def answer(case: dict):
    if "hma" in case:
        return [_hma(c) for c in case["hma"]]
    return {name: _backend(name, case["dtypes"], case["block_sizes"]) for name in case["backends"]}


if __name__ == "__main__":
    cases = json.load(sys.stdin)
    _ANSWER.write(json.dumps([answer(c) for c in cases]))
    _ANSWER.flush()
