"""KV connectors as inputs: a name, vLLM's ``kv_connector_extra_config``, members.

What each connector *wants* is not here: that is policy, in
``rules/connectors/<name>.yaml``. This module only knows which names exist,
so that a rule file for a misspelt connector is an error, not a silent no-op.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import Field, field_validator

from policy.spec import Frozen

__all__ = ["KNOWN_CONNECTORS", "ConnectorConfig", "suggest_connector"]

# vLLM's registered KV connector class names (vllm/distributed/kv_transfer/kv_connector/factory.py).
KNOWN_CONNECTORS: frozenset[str] = frozenset(
    {
        "DecodeBenchConnector",
        "ExampleConnector",
        "LMCacheConnectorV1",
        "LMCacheMPConnector",
        "MooncakeConnector",
        "MooncakeStoreConnector",
        "MultiConnector",
        "NixlConnector",
        "OffloadingConnector",
        "P2pNcclConnector",
        "SharedStorageConnector",
    }
)

Scalar = str | bool | int | float | None


class ConnectorConfig(Frozen):
    """A configured KV connector (vLLM's ``kv_transfer_config``).

    ``connectors`` holds the members of a composite connector such as
    MultiConnector; ``extra`` is ``kv_connector_extra_config`` with scalar values.
    Any name is accepted as input (vLLM loads connectors by name); rules for an
    unknown name simply never apply.
    """

    name: str = Field(min_length=1)
    extra: dict[str, Scalar] = Field(default_factory=dict)
    connectors: tuple[ConnectorConfig, ...] = ()

    def __hash__(self) -> int:  # extra is a dict: hash its sorted items
        return hash((self.name, tuple(sorted((k, repr(v)) for k, v in self.extra.items())), self.connectors))

    @field_validator("extra", mode="before")
    @classmethod
    def _scalars_only(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, (dict, list)):
                    raise ValueError(f"extra config `{key}` must be a scalar (string, number, bool, null)")
        return value

    @property
    def is_composite(self) -> bool:
        return bool(self.connectors)

    @classmethod
    def from_vllm(cls, name: str, extra: dict[str, Any] | None = None) -> ConnectorConfig:
        """Build from vLLM's form, where MultiConnector lists members in ``extra["connectors"]``."""
        extra = dict(extra or {})
        members = extra.pop("connectors", None) or []
        subs = tuple(
            cls.from_vllm(m.get("kv_connector", ""), m.get("kv_connector_extra_config")) for m in members
        )
        return cls(name=name, extra=extra, connectors=subs)


def suggest_connector(name: str) -> str | None:
    close = difflib.get_close_matches(name, sorted(KNOWN_CONNECTORS), n=1)
    return close[0] if close else None
