# ruff: noqa  (hostile-pass scripts, not product code)
"""Class 6: documents the JSON Schema (`kvpolicy schema`) accepts and the loader refuses (beyond
LOADER_ONLY_CHECKS), and the reverse. Key-level and structural edits the property test
(tests/policy/test_json_schema.py, value edits) does not make. Run: python hostile/class6_schema.py"""
from __future__ import annotations

import sys
from pathlib import Path

import jsonschema
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _common import report, summary

from kvpolicy.engine.cli.schema import rule_file_schema
from kvpolicy.policy.errors import RuleLoadError
from kvpolicy.policy.json_schema import LOADER_ONLY_CHECKS
from kvpolicy.policy.load import load_rules_from_texts

V = jsonschema.Draft202012Validator(rule_file_schema())
R = "  - id: r\n    description: d\n"


def g(rule_body: str, head: str = "version: 1\n") -> tuple[str, str]:
    return "global.yaml", head + "rules:\n" + R + rule_body


def c(rule_body: str, conn: str = "NixlConnector", extra: str = "") -> tuple[str, str]:
    return "connectors/x.yaml", f"version: 1\nconnector: {conn}\n{extra}rules:\n" + R + rule_body


DOCS = {
    "when-empty-map": g("    when: {}\n    forbid: {placement: cross_layer}\n"),
    "when-null": g("    when: null\n    forbid: {placement: cross_layer}\n"),
    "all-empty": g("    when: {all: []}\n    forbid: {placement: cross_layer}\n"),
    "any-empty": g("    when: {any: []}\n    forbid: {placement: cross_layer}\n"),
    "not-empty": g("    when: {not: {}}\n    forbid: {placement: cross_layer}\n"),
    "two-ops-one-leaf": g("    when: {field: kv.num_layers, ge: 8, le: 4}\n    forbid: {placement: cross_layer}\n"),
    "leaf-and-all": g("    when: {field: kv.num_layers, ge: 8, all: []}\n    forbid: {placement: cross_layer}\n"),
    "in-empty": g("    when: {field: kv.num_layers, in: []}\n    forbid: {placement: cross_layer}\n"),
    "not_in-empty": g("    when: {field: kv.num_layers, not_in: []}\n    forbid: {placement: cross_layer}\n"),
    "in-duplicates": g("    when: {field: kv.num_layers, in: [4, 4]}\n    forbid: {placement: cross_layer}\n"),
    "in-mixed-types": g("    when: {field: kv.num_layers, in: [4, a]}\n    forbid: {placement: cross_layer}\n"),
    "in-null-item": g("    when: {field: kv.num_layers, in: [null]}\n    forbid: {placement: cross_layer}\n"),
    "in-scalar": g("    when: {field: kv.num_layers, in: 4}\n    forbid: {placement: cross_layer}\n"),
    "eq-null": g("    when: {field: kv.num_layers, eq: null}\n    forbid: {placement: cross_layer}\n"),
    "eq-list": g("    when: {field: kv.num_layers, eq: [4]}\n    forbid: {placement: cross_layer}\n"),
    "eq-bool-for-int": g("    when: {field: kv.num_layers, eq: true}\n    forbid: {placement: cross_layer}\n"),
    "gt-bool": g("    when: {field: kv.num_layers, gt: true}\n    forbid: {placement: cross_layer}\n"),
    "gt-string": g("    when: {field: kv.num_layers, gt: '4'}\n    forbid: {placement: cross_layer}\n"),
    "gt-on-string-field": g("    when: {field: backend.name, gt: 4}\n    forbid: {placement: cross_layer}\n"),
    "exists-string": g("    when: {field: connector.extra.x, exists: 'yes'}\n    forbid: {placement: cross_layer}\n"),
    "exists-on-core-field": g("    when: {field: kv.num_layers, exists: true}\n    forbid: {placement: cross_layer}\n"),
    "extra-empty-key": g("    when: {field: connector.extra., eq: 1}\n    forbid: {placement: cross_layer}\n"),
    "extra-dotted-key": g("    when: {field: connector.extra.a.b, eq: 1}\n    forbid: {placement: cross_layer}\n"),
    "extra-space-key": g("    when: {field: 'connector.extra.a b', eq: 1}\n    forbid: {placement: cross_layer}\n"),
    "extra-unicode-key": g("    when: {field: connector.extra.\u00e9, eq: 1}\n    forbid: {placement: cross_layer}\n"),
    "extra-newline-key": g("    when: {field: \"connector.extra.a\\n\", eq: 1}\n    forbid: {placement: cross_layer}\n"),
    "extra-long-key": g("    when: {field: connector.extra." + "k" * 5000 + ", eq: 1}\n    forbid: {placement: cross_layer}\n"),
    "extra-in-nested-list": g("    when: {field: connector.extra.x, in: [[1]]}\n    forbid: {placement: cross_layer}\n"),
    "extra-eq-map": g("    when: {field: connector.extra.x, eq: {a: 1}}\n    forbid: {placement: cross_layer}\n"),
    "unknown-field": g("    when: {field: kv.nope, eq: 1}\n    forbid: {placement: cross_layer}\n"),
    "field-case": g("    when: {field: KV.num_layers, eq: 1}\n    forbid: {placement: cross_layer}\n"),
    "pattern-empty": g("    forbid: {}\n"),
    "pattern-null": g("    forbid: null\n"),
    "pattern-layout-empty-list": g("    forbid: {layout: []}\n"),
    "pattern-contradiction": g("    forbid: {layout: LBHNC, placement: per_layer}\n"),
    "pattern-lowercase-layout": g("    forbid: {layout: lbhnc}\n"),
    "pattern-legacy-alias": g("    forbid: {layout: per_layer/HND}\n"),
    "pattern-layout-dup-alias": g("    forbid: {layout: [LBHNC, per_layer/HND]}\n"),
    "pattern-head-order-lower": g("    forbid: {head_order: hnd}\n"),
    "pattern-bool-as-string": g("    forbid: {block_outermost: 'true'}\n"),
    "pattern-unknown-key": g("    forbid: {colour: red}\n"),
    "two-effects": g("    forbid: {placement: cross_layer}\n    require: {placement: per_layer}\n"),
    "no-effect": g(""),
    "weight-on-forbid": g("    forbid: {placement: cross_layer}\n    weight: 5\n"),
    "weight-zero": g("    prefer: {placement: cross_layer}\n    weight: 0\n"),
    "weight-negative": g("    prefer: {placement: cross_layer}\n    weight: -5\n"),
    "weight-int64max": g("    prefer: {placement: cross_layer}\n    weight: 9223372036854775807\n"),
    "weight-bool": g("    prefer: {placement: cross_layer}\n    weight: true\n"),
    "weight-string": g("    prefer: {placement: cross_layer}\n    weight: '5'\n"),
    "description-empty": ("global.yaml", "version: 1\nrules:\n  - id: r\n    description: ''\n    forbid: {placement: cross_layer}\n"),
    "description-blank": ("global.yaml", "version: 1\nrules:\n  - id: r\n    description: '   '\n    forbid: {placement: cross_layer}\n"),
    "description-int": ("global.yaml", "version: 1\nrules:\n  - id: r\n    description: 5\n    forbid: {placement: cross_layer}\n"),
    "description-surrogate": ("global.yaml", "version: 1\nrules:\n  - id: r\n    description: \"\\ud800\"\n    forbid: {placement: cross_layer}\n"),
    "description-nul": ("global.yaml", "version: 1\nrules:\n  - id: r\n    description: \"a\\0b\"\n    forbid: {placement: cross_layer}\n"),
    "reference-null": g("    reference: null\n    forbid: {placement: cross_layer}\n"),
    "reference-empty": g("    reference: ''\n    forbid: {placement: cross_layer}\n"),
    "id-unicode": ("global.yaml", "version: 1\nrules:\n  - id: r\u00e9\n    description: d\n    forbid: {placement: cross_layer}\n"),
    "id-trailing-dot": ("global.yaml", "version: 1\nrules:\n  - id: r.\n    description: d\n    forbid: {placement: cross_layer}\n"),
    "id-long": ("global.yaml", "version: 1\nrules:\n  - id: " + "r" * 5000 + "\n    description: d\n    forbid: {placement: cross_layer}\n"),
    "id-int": ("global.yaml", "version: 1\nrules:\n  - id: 5\n    description: d\n    forbid: {placement: cross_layer}\n"),
    "version-2": g("    forbid: {placement: cross_layer}\n", "version: 2\n"),
    "version-string": g("    forbid: {placement: cross_layer}\n", "version: '1'\n"),
    "version-float": g("    forbid: {placement: cross_layer}\n", "version: 1.0\n"),
    "version-missing": g("    forbid: {placement: cross_layer}\n", ""),
    "rules-null": ("global.yaml", "version: 1\nrules: null\n"),
    "rules-missing": ("global.yaml", "version: 1\n"),
    "rules-map": ("global.yaml", "version: 1\nrules: {a: 1}\n"),
    "top-unknown-key": ("global.yaml", "version: 1\nrules: []\ncolour: red\n"),
    "top-key-case": ("global.yaml", "version: 1\nRules: []\n"),
    "empty-document": ("global.yaml", ""),
    "top-list": ("global.yaml", "- 1\n"),
    "defaults-empty": ("global.yaml", "version: 1\ndefaults: {}\nrules: []\n"),
    "defaults-null": ("global.yaml", "version: 1\ndefaults: null\nrules: []\n"),
    "layout-order-empty": ("global.yaml", "version: 1\ndefaults: {layout_order: []}\nrules: []\n"),
    "layout-order-lower-dup": ("global.yaml", "version: 1\ndefaults: {layout_order: [LBHNC, lbhnc]}\nrules: []\n"),
    "layout-order-pattern": ("global.yaml", "version: 1\ndefaults: {layout_order: [{layout: LBHNC}]}\nrules: []\n"),
    "layout-order-alias-dup-2": ("global.yaml", "version: 1\ndefaults: {layout_order: [per_layer/NHD, LBNHC]}\nrules: []\n"),
    "layout-order-unknown-key": ("global.yaml", "version: 1\ndefaults: {layout_order: [LBHNC], tie: 1}\nrules: []\n"),
    "member-prefs-on-global": ("global.yaml", "version: 1\nmember_preferences: any\nrules: []\n"),
    "member-prefs-non-composite": c("    forbid: {placement: cross_layer}\n", "NixlConnector", "member_preferences: any\n"),
    "member-prefs-upper": c("    forbid: {placement: cross_layer}\n", "MultiConnector", "member_preferences: ANY\n"),
    "connector-null": ("connectors/x.yaml", "version: 1\nconnector: null\nrules: []\n"),
    "connector-empty": ("connectors/x.yaml", "version: 1\nconnector: ''\nrules: []\n"),
    "connector-129": ("connectors/x.yaml", "version: 1\nconnector: " + "C" * 129 + "\nrules: []\n"),
    "connector-unicode": ("connectors/x.yaml", "version: 1\nconnector: Conn\u00e9ctor\nrules: []\n"),
    "connector-digit": ("connectors/x.yaml", "version: 1\nconnector: 1Conn\nrules: []\n"),
    "connector-int": ("connectors/x.yaml", "version: 1\nconnector: 5\nrules: []\n"),
    "connector-field-in-global": g("    when: {field: connector.name, eq: NixlConnector}\n    forbid: {placement: cross_layer}\n"),
    "connector-name-in-list": g("    when: {field: connector.name, in: [NixlConnector, 'x y']}\n    forbid: {placement: cross_layer}\n"),
    "vllm-profile-unknown": g("    when: {field: vllm.profile, eq: vllm-9.99}\n    forbid: {placement: cross_layer}\n"),
    "backend-name-unknown": g("    when: {field: backend.name, eq: NOPE_ATTN}\n    forbid: {placement: cross_layer}\n"),
    "kv-cache-dtype-unknown": g("    when: {field: kv.cache_dtype, eq: float128}\n    forbid: {placement: cross_layer}\n"),
    "env-layout-lower": g("    when: {field: env.VLLM_KV_CACHE_LAYOUT, eq: hnd}\n    forbid: {placement: cross_layer}\n"),
    "num-layers-float": g("    when: {field: kv.num_layers, eq: 4.5}\n    forbid: {placement: cross_layer}\n"),
    "num-layers-negative": g("    when: {field: kv.num_layers, lt: -5}\n    forbid: {placement: cross_layer}\n"),
    "deep-not-30": g("    when: " + "{not: " * 30 + "{field: kv.num_layers, eq: 1}" + "}" * 30 + "\n    forbid: {placement: cross_layer}\n"),
    "rule-unknown-key": g("    forbid: {placement: cross_layer}\n    colour: red\n"),
    "rule-null-item": ("global.yaml", "version: 1\nrules:\n  - null\n"),
}


def loader_only(code: str, msg: str) -> bool:
    return any(chk.covers(code, msg) for chk in LOADER_ONLY_CHECKS)


def main() -> None:
    for name, (fname, text) in DOCS.items():
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            data = "<unparsable>"
        schema_errs = [e.message[:100] for e in V.iter_errors(data)] if data != "<unparsable>" else ["unparsable"]
        try:
            load_rules_from_texts({fname: text})
            loader = []
        except RuleLoadError as e:
            loader = [(d.code, d.message) for d in e.diagnostics]
        except Exception as e:  # a traceback from the loader
            report(f"c6/{name}", False, f"loader raised {type(e).__name__}: {str(e)[:100]}",
                   f"python -c \"from kvpolicy.policy.load import load_rules_from_texts as L; L({{{fname!r}: {text!r}}})\"")
            continue
        unlisted = [f"{c}: {m[:90]}" for c, m in loader if not loader_only(c, m)]
        if not schema_errs and unlisted:
            ok, why = False, f"schema accepts, loader refuses (not loader-only): {unlisted[0]}"
        elif schema_errs and not loader:
            ok, why = False, f"loader accepts, schema refuses: {schema_errs[0]}"
        else:
            ok = True
            why = ("both accept" if not schema_errs and not loader else
                   "both refuse" if schema_errs else f"loader refuses a loader-only check: {loader[0][0]}")
        report(f"c6/{name}", ok, why, f"python hostile/class6_schema.py  (document {name}: {text[-90:]!r})")
    summary("6")


if __name__ == "__main__":
    main()
