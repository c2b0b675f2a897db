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

from kvpolicy.engine.cli.common import usage_error
from kvpolicy.engine.connector_names import check_connector_names, out_of_tree_names
from kvpolicy.policy.context import Context
from kvpolicy.policy.ruleset import RuleSet

__all__ = ["check_connectors", "out_of_tree_names"]


def _flag(args: argparse.Namespace, member: bool) -> str:
    """The flag that named the connector: a MultiConnector member is in the connector's config."""
    if getattr(args, "kv_transfer_config", None) is not None:
        return "--kv-transfer-config"
    return "--connector-config" if member else "--connector"


def check_connectors(ctx: Context, ruleset: RuleSet, args: argparse.Namespace) -> list[str]:
    """Refuse a connector the release does not register and nothing declares out-of-tree (a `UsageError`
    at the flag that named it); return the warnings about the others, as printed."""
    return check_connector_names(
        ctx, ruleset, out_of_tree_names(args),
        lambda member, message, help: usage_error(_flag(args, member), message, help),
        module_key="--connector-module-path",
        declare="pass --connector-module-path MODULE (or kv_connector_module_path in --kv-transfer-config)",
        prefers_key="--connector-prefers-cross-layer-blocks NAME=true")
