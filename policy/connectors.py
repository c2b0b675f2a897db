"""KV connectors as inputs: a name, vLLM's ``kv_connector_extra_config``, members.

What each connector *wants* is not here: that is policy, in
``rules/connectors/<name>.yaml``. This module knows which names the release
profiles register and what a well-formed name is: a connector file may name
any well-formed connector (a third-party one, or one newer than every
profile); a name one typo away from a known one is a warning (`near_connector`).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from typing import Any

from pydantic import Field, field_validator

from kvpolicy.policy.errors import input_error
from kvpolicy.policy.spec import Frozen
from kvpolicy.policy.yaml_source import INT64_MAX, INT64_MIN

__all__ = [
    "COMPOSITE_CONNECTORS",
    "CONNECTOR_NAME_MAX",
    "KNOWN_CONNECTORS",
    "ConnectorConfig",
    "check_extra_config",
    "connector_name_problem",
    "flatten_extra",
    "near_connector",
    "suggest_connector",
]

def _registered() -> frozenset[str]:
    from kvpolicy.policy.releases import iter_profiles

    return frozenset(name for profile in iter_profiles() for name in profile.connectors)


# The KV connector names vLLM registers in any shipped release profile
# (vllm/distributed/kv_transfer/kv_connector/factory.py of each release).
KNOWN_CONNECTORS: frozenset[str] = _registered()

Scalar = str | bool | int | float | None

# Connectors that run member connectors (vLLM's MultiConnector lists them in its extra config).
COMPOSITE_CONNECTORS: frozenset[str] = frozenset({"MultiConnector"})


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
    prefers_cross_layer_blocks: bool | None = Field(
        default=None, description="the connector object's own `prefer_cross_layer_blocks` (what vLLM 0.24-0.28's "
        "gate asks it); None: not given (a registered connector's rules say when it prefers; any other connector "
        "has KVConnectorBase_V1's default, false)")

    def __hash__(self) -> int:  # extra is a dict: hash its sorted items
        return hash((self.name, tuple(sorted((k, repr(v)) for k, v in self.extra.items())), self.connectors,
                     self.prefers_cross_layer_blocks))

    def with_cross_layer_preferences(self, preferences: bool | dict[str, bool], where: str) -> ConnectorConfig:
        """This connector with ``prefers_cross_layer_blocks`` set: a bool for this connector itself (not a
        composite: its members' answers make its own), or a mapping of connector names in the tree to theirs.
        A name the tree does not hold, or a value that is not a boolean, is an `InputError` at ``where``."""
        if isinstance(preferences, bool):
            if self.is_composite:
                raise input_error(where, f"`{self.name}` prefers cross-layer blocks when all its members do",
                                  "give each member's answer by name, e.g. {\"MyConnector\": true}")
            return self.model_copy(update={"prefers_cross_layer_blocks": preferences})
        if not isinstance(preferences, dict) or not preferences:
            raise input_error(where, "expected true, false, or a non-empty mapping of connector names to true/false",
                              'e.g. true, or {"MyConnector": true}')
        names = set(self.names())
        for name, value in preferences.items():
            if name not in names:
                close = difflib.get_close_matches(str(name), sorted(names), n=1)
                raise input_error(f"{where}.{name}", f"no configured connector is named `{name}`",
                                  (f"did you mean `{close[0]}`? " if close else "") + "configured: "
                                  + ", ".join(sorted(names)))
            if not isinstance(value, bool):
                raise input_error(f"{where}.{name}", f"`{name}`'s prefer_cross_layer_blocks must be true or false, "
                                  f"got `{value!r}`", "what the connector class's prefer_cross_layer_blocks answers")
        return self._with_preferences(preferences)

    def _with_preferences(self, preferences: dict[str, bool]) -> ConnectorConfig:
        members = tuple(m._with_preferences(preferences) for m in self.connectors)
        own = preferences.get(self.name, self.prefers_cross_layer_blocks)
        return self.model_copy(update={"connectors": members, "prefers_cross_layer_blocks": own})

    def names(self) -> list[str]:
        """This connector's name and its members', depth first."""
        return [self.name, *(n for m in self.connectors for n in m.names())]

    @field_validator("extra", mode="before")
    @classmethod
    def _flat_scalars(cls, value: Any) -> Any:
        return flatten_extra(value) if isinstance(value, dict) else value

    @property
    def is_composite(self) -> bool:
        return bool(self.connectors)

    @classmethod
    def from_vllm(cls, name: str, extra: dict[str, Any] | None = None, *, where: str = "connector_config"
                  ) -> ConnectorConfig:
        """Build from vLLM's form: ``kv_connector`` and ``kv_connector_extra_config``.

        Only a composite connector (MultiConnector) takes members, listed in
        ``extra["connectors"]`` as ``{"kv_connector": NAME, "kv_connector_extra_config": {...}}``;
        for any other connector that key is ordinary extra config, as vLLM reads it.
        """
        if not isinstance(name, str) or not name:
            raise input_error(where, f"a connector name must be a non-empty string, got `{name!r}`")
        if not _is_text(name):
            raise input_error(where, f"the connector name `{name!r}` is not valid Unicode text (a lone surrogate)",
                              "give the class name as plain text")
        check_extra_config(extra, where)
        extra = dict(extra or {})
        subs: list[ConnectorConfig] = []
        if name in COMPOSITE_CONNECTORS and "connectors" in extra:
            members = extra.pop("connectors")
            if not isinstance(members, list):
                raise input_error(f"{where}.connectors", f"`connectors` must be a list, got {type(members).__name__}",
                                  'e.g. {"connectors": [{"kv_connector": "NixlConnector"}]}')
            for i, m in enumerate(members):
                at = f"{where}.connectors[{i}]"
                if not isinstance(m, dict) or not isinstance(m.get("kv_connector"), str) or not m["kv_connector"]:
                    raise input_error(at, f"member {i} of `connectors` needs a `kv_connector` name",
                                      'e.g. {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {}}')
                member_extra = m.get("kv_connector_extra_config")
                member_extra = {} if member_extra is None else member_extra  # `[]` or `""` is no mapping
                if not isinstance(member_extra, dict):
                    raise input_error(f"{at}.kv_connector_extra_config",
                                      f"member {i}'s `kv_connector_extra_config` must be a mapping, "
                                      f"got {type(member_extra).__name__}")
                subs.append(cls.from_vllm(m["kv_connector"], member_extra, where=at))
        return cls(name=name, extra=extra, connectors=tuple(subs))


MAX_CONFIG_DEPTH = 64  # as rule files' `Limits.max_depth`


def _is_text(text: str) -> bool:
    """Whether ``text`` is valid Unicode (encodes as UTF-8): JSON's ``"\\ud800"`` escape and undecodable
    argv bytes give lone surrogates, which no output (text, JSON, a terminal) can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


MAX_CONFIG_VALUES = 100_000  # values in one extra config: a shared or self-referring object is refused, not walked


def check_extra_config(value: Any, where: str) -> None:
    """Raise an `InputError` located at the key (``where.key[2].sub``) unless ``value`` (a connector's
    ``kv_connector_extra_config``) holds only what JSON, and so vLLM's ``--kv-transfer-config``, can:
    string keys of valid Unicode; strings, finite numbers (integers within 64 bits), booleans, nulls,
    lists and mappings; at most `MAX_CONFIG_DEPTH` levels and `MAX_CONFIG_VALUES` values (so an object
    that contains itself is refused, not walked forever). Iterative: no recursion limit to hit.

    The CLI's ``--kv-transfer-config`` and ``--connector-config`` and the vLLM plugin's objects
    (whose Python API takes any dict) are checked by this one function."""
    stack: list[tuple[Any, str, int]] = [(value, where, 1)]
    seen = 0
    while stack:
        item, at, level = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES:
            raise input_error(where, f"`kv_connector_extra_config` holds more than {MAX_CONFIG_VALUES:,} values "
                              "(or an object that contains itself)", "vLLM's connectors read a few keys",
                              code="too-large")
        if isinstance(item, (dict, list, tuple)) and level > MAX_CONFIG_DEPTH:
            raise input_error(where, f"`kv_connector_extra_config` is nested deeper than {MAX_CONFIG_DEPTH} levels "
                              "(or contains itself)", "flatten the configuration; vLLM's connectors read a few "
                              "levels at most", code="too-deep")
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise input_error(at, f"key `{key!r}` is a {type(key).__name__}; connector config keys are "
                                      "strings", "use JSON: string keys only")
                if not _is_text(key):
                    raise input_error(at, f"key `{key!r}` is not valid Unicode text (a lone surrogate)",
                                      "write the key as plain text; JSON's `\\ud800` escapes cannot be printed")
                stack.append((child, f"{at}.{key}", level + 1))
        elif isinstance(item, (list, tuple)):
            stack += [(child, f"{at}[{i}]", level + 1) for i, child in enumerate(item)]
        elif isinstance(item, str):
            if not _is_text(item):
                raise input_error(at, f"the string `{item[:40]!r}` is not valid Unicode text (a lone surrogate)",
                                  "write the value as plain text; JSON's `\\ud800` escapes cannot be printed")
        elif isinstance(item, float):
            if not math.isfinite(item):  # a rule cannot compare NaN, and the JSON output would not be JSON
                raise input_error(at, f"`{at.rsplit('.', 1)[-1]}` is `{item}`, not a number a rule can compare",
                                  "give a finite number, or a string")
        elif isinstance(item, int) and not isinstance(item, bool):
            if not INT64_MIN <= item <= INT64_MAX:  # past 4,300 digits Python cannot even print it
                raise input_error(at, f"an integer of {item.bit_length()} bits, outside the 64-bit range",
                                  "give a number within 64 bits, or a string")
        elif item is not None and not isinstance(item, bool):
            raise input_error(at, f"a {type(item).__name__} is no JSON value", "use strings, numbers, booleans, "
                              "null, lists and mappings, as vLLM's --kv-transfer-config takes them")


def flatten_extra(extra: dict[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """``kv_connector_extra_config`` as rules see it: nested mappings become dotted keys
    (``{"a": {"b": 1}}`` -> ``a.b``), lists their JSON text, and null values are dropped
    (vLLM's ``extra.get(key)`` treats a null as unset)."""
    out: dict[str, Scalar] = {}
    for key, value in extra.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_extra(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value, sort_keys=True)
        elif value is not None:
            out[name] = value
    return out


def suggest_connector(name: str) -> str | None:
    """The known connector ``name`` most likely means (``Nixl`` -> ``NixlConnector``), if any."""
    close = difflib.get_close_matches(name, sorted(KNOWN_CONNECTORS), n=1)
    if close:
        return close[0]
    prefixed = sorted(k for k in KNOWN_CONNECTORS if k.lower().startswith(name.lower())) if name else []
    return prefixed[0] if len(prefixed) == 1 else None


# A well-formed connector name is what vLLM's `KVConnectorFactory` can name: a Python class name
# (ASCII letters, digits and `_`, not starting with a digit), here at most 128 characters.
# vLLM registers connectors by class name, and a third-party one is loaded by
# `kv_connector_module_path` + `kv_connector` (the class name), so nothing else can ever be active.
CONNECTOR_NAME_MAX = 128
_CONNECTOR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def connector_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a KV connector's class name, or None when it is well-formed."""
    if len(name) > CONNECTOR_NAME_MAX:
        return f"a connector name is at most {CONNECTOR_NAME_MAX} characters, got {len(name)}"
    if not _CONNECTOR_NAME.fullmatch(name):
        return (f"`{name}` is not a connector class name: use ASCII letters, digits and `_`, "
                "not starting with a digit")
    return None


def _edit_distance(a: str, b: str, limit: int) -> int:
    """Levenshtein distance of ``a`` and ``b``, or ``limit + 1`` once it exceeds ``limit``."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
        if min(row) > limit:
            return limit + 1
    return row[-1]


NEAR_DISTANCE = 2  # edits (insert, delete, substitute) that make a name "near" another


def near_connector(name: str, others: frozenset[str] | set[str] | tuple[str, ...]) -> str | None:
    """The name in ``others`` that ``name`` most likely misspells, or None.

    Near: equal ignoring case, or within `NEAR_DISTANCE` edits (case-insensitive) of a name at
    least 6 characters long; ``name`` itself is never near itself. Ties go to the smallest
    distance, then alphabetically, so the answer is deterministic. ``NixlConector`` ->
    ``NixlConnector``; ``MyConnector`` is near nothing known.
    """
    best: tuple[int, str] | None = None
    low = name.lower()
    for other in sorted(others):
        if other == name:
            continue
        d = 0 if other.lower() == low else _edit_distance(low, other.lower(), NEAR_DISTANCE)
        if d > NEAR_DISTANCE or (d > 0 and min(len(name), len(other)) < 6):
            continue
        if best is None or d < best[0]:
            best = (d, other)
    return None if best is None else best[1]
