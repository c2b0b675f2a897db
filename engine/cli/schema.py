"""``kvpolicy schema``: the JSON Schema of the rule file format (or of policy test files).

The committed copy, docs/rule-file.schema.json, is what the shipped rule files
name for editors (``# yaml-language-server: $schema=...``); a test keeps it
equal to this output. Docs are not installed: an operator writes this output
beside their rules and names it there.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvpolicy.engine.cli.common import EXIT_OK, HelpFormatter

__all__ = ["case_file_schema", "register", "rule_file_schema", "run"]

_EPILOG = """\
examples:
  kvpolicy schema > rule-file.schema.json           # beside your rules, for editors
  kvpolicy schema --cases > policy-test.schema.json

editors: start a rule file with (the path relative to it; ../ in connectors/)
  # yaml-language-server: $schema=./rule-file.schema.json
"""


def rule_file_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of a rule file, as strict as `kvpolicy validate` where it can be
    (`kvpolicy.policy.json_schema`)."""
    from kvpolicy.policy.json_schema import rule_file_schema

    return rule_file_schema()


def case_file_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of a policy test file, as strict as `kvpolicy test`'s loader where it can be
    (`kvpolicy.engine.policy_tests.json_schema`)."""
    from kvpolicy.engine.policy_tests.json_schema import case_file_schema

    return case_file_schema()


def schema_text(cases: bool = False) -> str:
    """The schema exactly as printed (and committed): 2-space indent, trailing newline."""
    return json.dumps(case_file_schema() if cases else rule_file_schema(), indent=2) + "\n"


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "schema", help="print the JSON Schema of the rule file format",
        description="Print the JSON Schema (draft 2020-12) of kvpolicy's rule files, for editors and CI.",
        epilog=_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--cases", action="store_true", help="the schema of policy test files (kvpolicy test) instead")
    p.add_argument("--format", choices=("json",), default="json",
                   help="always json (a JSON Schema, versioned by its `$id`); accepted as every verb accepts it")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(schema_text(args.cases), end="")
    return EXIT_OK
