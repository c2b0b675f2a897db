"""Oracle: the connector class vLLM loads for each registered name, by its kv_connector_extra_config.

Case ``{"probes": {key: [value, ...]}}`` -> ``{name: {"default": cls, "by_key": {key: {value: cls}}}}`` for
every name ``KVConnectorFactory`` registers: the class ``KVConnectorFactory.get_connector_class`` returns for a
``KVTransferConfig(kv_connector=name, kv_role="kv_both")`` without extra config (``default``) and with
``kv_connector_extra_config={key: value}``; ``"error: Type: msg"`` where vLLM refuses that value (0.34's
"Invalid NixlConnector transfer_mode"). Runs under every release 0.24.0 on.

STAND-IN: the connector modules' imports. A registered loader whose module needs a package this site lacks
(nixl, lmcache, ...) is replaced by one returning an empty class named as the registry's lazy loader names it
(``register_connector(name, module_path, class_name)``): which loader ``get_connector_class`` calls is vLLM's
choice; only the import is stood in for.
"""

from __future__ import annotations

import inspect
import json
import sys

from _host import pin_host

pin_host()  # the machine vLLM reads is _host.HOST, whatever runs this (see _host.py)

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402


def _stand_in(name, loader):
    def load():
        try:
            return loader()
        except Exception:  # STAND-IN: see the docstring
            return type(inspect.getclosurevars(loader).nonlocals["class_name"], (), {})
    return load


registry = KVConnectorFactory._registry
for _name in list(registry):
    registry[_name] = _stand_in(_name, registry[_name])


def loads(name, extra):
    try:
        config = KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_connector_extra_config=extra)
        return KVConnectorFactory.get_connector_class(config).__name__
    except Exception as exc:
        return f"error: {type(exc).__name__}: {exc}"


def answer(case):
    return {name: {"default": loads(name, {}),
                   "by_key": {key: {v: loads(name, {key: v}) for v in values}
                              for key, values in case["probes"].items()}}
            for name in sorted(registry)}


print(json.dumps([answer(c) for c in json.load(sys.stdin)]))
