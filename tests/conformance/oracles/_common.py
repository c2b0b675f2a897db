"""Stand-ins and helpers shared by the oracles (imported by them, under the release).

Each stand-in exists only because the oracles run on a CPU without the CUDA stack;
the oracles' docstrings say where each one is used.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types


class _Inert:
    """Placeholder for any name imported from a stubbed package."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        raise RuntimeError("stub package called")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Inert,), {})
        setattr(self, name, value)
        return value


class _StubFinder:
    """Meta path finder that serves `root` and its submodules as _StubModule."""

    def __init__(self, root):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        import importlib.machinery

        if fullname == self.root or fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


STUBBED: list[str] = []


STUBBED: list[str] = []


def stub_package(root):
    """Serve `root` (and its submodules) as inert stubs from now on."""
    if root not in STUBBED:
        STUBBED.append(root)
        sys.meta_path.insert(0, _StubFinder(root))
        for mod in [m for m in sys.modules if m == root or m.startswith(root + ".")]:
            del sys.modules[mod]


def backend_class(name):
    """The backend class from vLLM's registry; flashinfer stubbed only if it is missing."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        return AttentionBackendEnum[name].get_class()
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "flashinfer":
            raise
        stub_package("flashinfer")
        return AttentionBackendEnum[name].get_class()


@contextlib.contextmanager
def device_capability(cap):
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    value = None if cap is None else DeviceCapability(int(cap[0]), int(cap[1]))
    saved = current_platform.__dict__.get("get_device_capability")
    current_platform.get_device_capability = lambda device_id=0: value
    try:
        yield
    finally:
        if saved is None:
            del current_platform.get_device_capability
        else:
            current_platform.get_device_capability = saved


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def captured_warnings():
    """Warnings vLLM logs meanwhile; the *_once caches are cleared so each case logs."""
    import vllm.logger as vlog

    for fn in ("_print_debug_once", "_print_info_once", "_print_warning_once", "_print_error_once"):
        if hasattr(getattr(vlog, fn, None), "cache_clear"):
            getattr(vlog, fn).cache_clear()
    handler = _Capture()
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def gpu_platform_config():
    """While VllmConfig is built: skip the CPU platform's check_and_update_config (it
    demands triton-cpu) and answer get_hisparse_backend_cls as the CUDA platform does
    (the CPU platform has no HiSparse backend, so hisparse configs would be refused)."""
    from vllm.platforms import current_platform

    patches = {
        "check_and_update_config": lambda vllm_config: None,
        "get_hisparse_backend_cls": lambda: "vllm.v1.hisparse.backend.CUDAHiSparseBackend",
    }
    saved = {name: current_platform.__dict__.get(name) for name in patches}
    for name, fn in patches.items():
        setattr(current_platform, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            if fn is None:
                delattr(current_platform, name)
            else:
                setattr(current_platform, name, fn)


def answer_cases(handle, stream, error=lambda exc: {"error": f"{type(exc).__name__}: {exc}"}):
    """Read the JSON list of cases on stdin, answer each with ``handle`` (an exception becomes
    ``error(exc)``, so one case never sinks the others) and write the JSON list to ``stream``."""
    import json

    results = []
    for case in json.load(sys.stdin):
        try:
            results.append(handle(case))
        except Exception as exc:
            results.append(error(exc))
    stream.write(json.dumps(results) + "\n")
    stream.flush()
