"""dry-run's check of the connectors a deployment names, as vLLM checks them at start-up.

vLLM's ``KVConnectorFactory.get_connector_class`` loads a connector by its class name from the
release's registry, or, with ``kv_connector_module_path``, from that module; any other name is
``ValueError: Unsupported connector type`` and vLLM does not start. So a connector (or a MultiConnector
member) that the release does not register is refused (exit 2, located at the flag, with "did you
mean") unless the operator says it is out-of-tree: ``--connector-module-path MODULE`` (or
``kv_connector_module_path`` in ``--kv-transfer-config``, or in a member's config), or a connector
file for it in the rule set (rules written for a connector of their own). What is assumed then is
returned as warnings, which dry-run prints on stderr and puts in its JSON ``warnings``.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvpolicy.engine.cli.common import usage_error
from kvpolicy.policy.connectors import KNOWN_CONNECTORS, suggest_connector
from kvpolicy.policy.context import Context
from kvpolicy.policy.near_names import nearest
from kvpolicy.policy.releases import Resolver, get_profile
from kvpolicy.policy.ruleset import RuleSet

__all__ = ["check_connectors", "out_of_tree_names"]


def _members(config: Any) -> list[dict[str, Any]]:
    if not isinstance(config, dict):
        return []
    members = config.get("connectors")
    return [m for m in members if isinstance(m, dict)] if isinstance(members, list) else []


def out_of_tree_names(args: argparse.Namespace) -> set[str]:
    """The connector names the command line declares loaded from a module (``kv_connector_module_path``)."""
    names: set[str] = set()
    ktc = getattr(args, "kv_transfer_config", None)
    top = ktc.get("kv_connector") if isinstance(ktc, dict) else getattr(args, "connector", None)
    if (isinstance(ktc, dict) and ktc.get("kv_connector_module_path")) or getattr(args, "connector_module_path", None):
        if isinstance(top, str):
            names.add(top)
    config = ktc.get("kv_connector_extra_config") if isinstance(ktc, dict) else getattr(args, "connector_config", None)
    for member in _members(config):
        if member.get("kv_connector_module_path") and isinstance(member.get("kv_connector"), str):
            names.add(member["kv_connector"])
    return names


def _flag(args: argparse.Namespace, member: bool) -> str:
    """The flag that named the connector: a MultiConnector member is in the connector's config."""
    if getattr(args, "kv_transfer_config", None) is not None:
        return "--kv-transfer-config"
    return "--connector-config" if member else "--connector"


def check_connectors(ctx: Context, ruleset: RuleSet, args: argparse.Namespace) -> list[str]:
    """Refuse a connector the release does not register and nothing declares out-of-tree (a `UsageError`
    at the flag that named it); return the warnings about the others, as printed."""
    conn = ctx.connector
    if conn is None:
        return []
    profile = get_profile(ctx.profile)
    registered = set(profile.connectors)
    declared = out_of_tree_names(args)
    warnings: list[str] = []
    for node in [conn, *conn.connectors]:
        name = node.name
        if name in registered:
            continue
        if name not in declared and name not in ruleset.connectors:
            near = nearest(name, registered) or suggest_connector(name)
            known = ", ".join(sorted(registered))
            raise usage_error(
                _flag(args, node is not conn),
                f"{profile.version_label} registers no KV connector `{name}`: it would refuse to start "
                f"(KVConnectorFactory: \"Unsupported connector type: {name}\")",
                (f"did you mean `{near}`? " if near else "")
                + f"connectors of {profile.name}: {known}; a connector of your own is loaded by "
                "kv_connector_module_path: pass --connector-module-path MODULE (or kv_connector_module_path in "
                "--kv-transfer-config), and give its rules a connector file")
        if name not in declared:
            warnings.append(f"warning: connector `{name}` is not one {profile.version_label} registers; deciding "
                            f"with the rules of its connector file, as for a connector loaded by "
                            "kv_connector_module_path (vLLM starts only with one: --connector-module-path)")
        elif name not in ruleset.connectors:
            warnings.append(f"warning: connector `{name}` (from kv_connector_module_path): no connector file of the "
                            "rules names it, so only the global rules apply to it")
        if name not in KNOWN_CONNECTORS and node.prefers_cross_layer_blocks is None and \
                profile.resolver is Resolver.uniform_gate:
            warnings.append(f"note: connector `{name}` is not one vLLM registers; its prefer_cross_layer_blocks is "
                            "taken as KVConnectorBase_V1's default, false (if its class says otherwise: "
                            f"--connector-prefers-cross-layer-blocks {name}=true)")
    return warnings
