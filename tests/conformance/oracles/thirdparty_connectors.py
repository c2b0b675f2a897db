"""Out-of-tree KV connectors, loaded by vLLM as an operator loads one: ``kv_connector`` names the class,
``kv_connector_module_path`` this module (the oracles run with this directory on ``sys.path``).

Each answers only vLLM's ``get_required_kvcache_layout`` (the layout vLLM's resolution asks a connector
for), with a fixed answer in the name: a layout, a legacy head order (vLLM 0.29+ still reads NHD/HND,
and its docstring still says "e.g. HND, or NHD"), None, or a name vLLM does not know. Nothing else is
called: v034's oracles only ask the class; v028's make an instance the way they make vLLM's own
connectors (``cls.__new__`` and vLLM's base ``__init__``), whose ``prefer_cross_layer_blocks`` is the
base class's False.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1


def _connector(name: str, layout: str | None) -> type:
    def get_required_kvcache_layout(cls, vllm_config):
        return layout

    cls = type(name, (KVConnectorBase_V1,), {
        "__module__": __name__,
        "get_required_kvcache_layout": classmethod(get_required_kvcache_layout),
    })
    cls.__abstractmethods__ = frozenset()  # v028's oracle makes inert instances (cls.__new__ + the base __init__)
    return cls


RequiresHND = _connector("RequiresHND", "HND")
RequiresNHD = _connector("RequiresNHD", "NHD")
RequiresLBHNC = _connector("RequiresLBHNC", "LBHNC")
RequiresBLHNC = _connector("RequiresBLHNC", "BLHNC")
RequiresLHBNC = _connector("RequiresLHBNC", "LHBNC")
RequiresNothing = _connector("RequiresNothing", None)
RequiresUnknown = _connector("RequiresUnknown", "XYZ")
