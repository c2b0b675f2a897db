"""The connectors a deployment names, checked as vLLM checks them at start-up.

vLLM's ``KVConnectorFactory.get_connector_class`` loads a connector by its class name from the
release's registry, or, with ``kv_connector_module_path``, from that module; any other name is
``ValueError: Unsupported connector type`` and vLLM does not start. So a connector (or a MultiConnector
member) that the release does not register is refused (with "did you mean") unless the deployment says
it is out-of-tree (``kv_connector_module_path``: dry-run's ``--connector-module-path``, a fleet
deployment's or a test case's ``connector_module_path``, or the key in a kv_transfer_config or a
member's config), or the rule set has a connector file for it. One check for dry-run, fleets and
policy test cases; each places the refusal where the name was written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpolicy.policy.connectors import KNOWN_CONNECTORS, suggest_connector
from kvpolicy.policy.context import Context
from kvpolicy.policy.errors import PolicyError
from kvpolicy.policy.near_names import nearest
from kvpolicy.policy.releases import Resolver, get_profile
from kvpolicy.policy.ruleset import RuleSet

__all__ = ["check_connector_names", "out_of_tree_names"]

# refuse(is_member, message, help) -> the error to raise, placed where the name was written
Refuse = Callable[[bool, str, str], PolicyError]


def _members(config: Any) -> list[dict[str, Any]]:
    if not isinstance(config, dict):
        return []
    members = config.get("connectors")
    return [m for m in members if isinstance(m, dict)] if isinstance(members, list) else []


def out_of_tree_names(inputs: Any) -> set[str]:
    """The connector names ``inputs`` (dry-run's arguments, a case input, a fleet deployment: read by
    attribute) declare loaded from a module (``kv_connector_module_path``)."""
    names: set[str] = set()
    ktc = getattr(inputs, "kv_transfer_config", None)
    top = ktc.get("kv_connector") if isinstance(ktc, dict) else getattr(inputs, "connector", None)
    if (isinstance(ktc, dict) and ktc.get("kv_connector_module_path")) or getattr(inputs, "connector_module_path",
                                                                                  None):
        if isinstance(top, str):
            names.add(top)
    config = ktc.get("kv_connector_extra_config") if isinstance(ktc, dict) else getattr(inputs, "connector_config",
                                                                                         None)
    for member in _members(config):
        if member.get("kv_connector_module_path") and isinstance(member.get("kv_connector"), str):
            names.add(member["kv_connector"])
    return names


def check_connector_names(ctx: Context, ruleset: RuleSet, declared: set[str], refuse: Refuse, *,
                          module_key: str = "connector_module_path",
                          declare: str = "give connector_module_path: MODULE (or kv_connector_module_path in "
                                         "kv_transfer_config)",
                          prefers_key: str = "connector_prefers_cross_layer_blocks: {NAME: true}") -> list[str]:
    """Raise ``refuse(...)``'s error for a connector the release does not register and nothing declares
    out-of-tree; return the warnings about the others. ``module_key``, ``declare`` and ``prefers_key``
    spell the caller's settings in the advice (dry-run: its flags; a case or a fleet: its keys)."""
    conn = ctx.connector
    if conn is None:
        return []
    profile = get_profile(ctx.profile)
    registered = set(profile.connectors)
    warnings: list[str] = []
    for node in [conn, *conn.connectors]:
        name = node.name
        if name in registered:
            continue
        if name not in declared and name not in ruleset.connectors:
            near = nearest(name, registered) or suggest_connector(name)
            known = ", ".join(sorted(registered))
            raise refuse(
                node is not conn,
                f"{profile.version_label} registers no KV connector `{name}`: it would refuse to start "
                f"(KVConnectorFactory: \"Unsupported connector type: {name}\")",
                (f"did you mean `{near}`? " if near else "")
                + f"connectors of {profile.name}: {known}; a connector of your own is loaded by "
                f"kv_connector_module_path: {declare}, and give its rules a connector file")
        if name not in declared:
            warnings.append(f"warning: connector `{name}` is not one {profile.version_label} registers; deciding "
                            f"with the rules of its connector file, as for a connector loaded by "
                            f"kv_connector_module_path (vLLM starts only with one: {module_key})")
        elif name not in ruleset.connectors:
            warnings.append(f"warning: connector `{name}` (from kv_connector_module_path): no connector file of the "
                            "rules names it, so only the global rules apply to it")
        if name not in KNOWN_CONNECTORS and node.prefers_cross_layer_blocks is None and \
                profile.resolver is Resolver.uniform_gate:
            warnings.append(f"note: connector `{name}` is not one vLLM registers; its prefer_cross_layer_blocks is "
                            "taken as KVConnectorBase_V1's default, false (if its class says otherwise: "
                            f"{prefers_key.replace('NAME', name)})")
    return warnings
