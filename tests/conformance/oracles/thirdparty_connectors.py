"""Out-of-tree KV connectors, loaded by vLLM as an operator loads one: ``kv_connector`` names the class,
``kv_connector_module_path`` this module (the oracles run with this directory on ``sys.path``).

Each answers only what vLLM's layout decision asks a connector, with fixed answers in its name:
``get_required_kvcache_layout`` (a layout, a legacy head order (vLLM 0.29+ still reads NHD/HND, and
its docstring still says "e.g. HND, or NHD"), None, or a name vLLM does not know) and, for vLLM
0.28's gate, ``prefer_cross_layer_blocks`` (the base class's False unless the name says it prefers;
``PrefersPerLayerHND`` overrides it with False).
Nothing else is called: v034's oracles only ask the class; v028's make an instance the way they make
vLLM's own connectors (``cls.__new__`` and vLLM's base ``__init__``).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1


def _connector(name: str, layout: str | None, prefers: bool | None = None) -> type:
    def get_required_kvcache_layout(cls, vllm_config):
        return layout

    attrs = {"__module__": __name__, "get_required_kvcache_layout": classmethod(get_required_kvcache_layout)}
    if prefers is not None:  # vLLM 0.28's gate asks it; the base class answers False
        attrs["prefer_cross_layer_blocks"] = property(lambda self: prefers)
    cls = type(name, (KVConnectorBase_V1,), attrs)
    cls.__abstractmethods__ = frozenset()  # v028's oracle makes inert instances (cls.__new__ + the base __init__)
    return cls


RequiresHND = _connector("RequiresHND", "HND")
RequiresNHD = _connector("RequiresNHD", "NHD")
RequiresLBHNC = _connector("RequiresLBHNC", "LBHNC")
RequiresBLHNC = _connector("RequiresBLHNC", "BLHNC")
RequiresLHBNC = _connector("RequiresLHBNC", "LHBNC")
RequiresNothing = _connector("RequiresNothing", None)
RequiresUnknown = _connector("RequiresUnknown", "XYZ")
PrefersCrossLayer = _connector("PrefersCrossLayer", None, prefers=True)
PrefersCrossLayerHND = _connector("PrefersCrossLayerHND", "HND", prefers=True)
PrefersPerLayerHND = _connector("PrefersPerLayerHND", "HND", prefers=False)  # says the base class's False itself
