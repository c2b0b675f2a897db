"""Generate docs/rule-language.md from the models, so the reference cannot drift.

    python -m kvpolicy.policy.reference > docs/rule-language.md

A test compares the committed file with this output.
"""

from __future__ import annotations

from kvpolicy.policy.context import EXTRA_PREFIX, FIELDS
from kvpolicy.policy.layouts import ALL_LAYOUTS, LEGACY_NAMES, HeadOrder, Layout, LayoutPattern, Placement
from kvpolicy.policy.releases import ReleaseProfile, iter_profiles
from kvpolicy.policy.rule_model import OPERATORS, Defaults, MemberPreferences, Rule, RuleFile, Waiver

__all__ = ["render_reference"]

_WORKED_EXAMPLE = """\
The built-in example of `kvpolicy dry-run`, under the default profile
`vllm-0.34`: Qwen2.5-0.5B's KV geometry (24 layers, 2 KV heads, head 64, the
release's default block size 64), `kv_cache_dtype=fp8_per_token_head`,
attention backend TRITON_ATTN, OffloadingConnector. The rules it meets:

```yaml
# rules/vllm-0.34/global.yaml (one of its rules)
version: 1
rules:
  - id: extensible-kv-cache-with-connector-needs-block-compact
    description: >-
      an extensible KV cache commits one contiguous run per layer only under a
      block-compact layout, which KV connectors need to register its memory
    reference: vllm/v1/attention/backends/utils.py resolve_kv_cache_layout
    when:
      all:
        - {field: cache.enable_extensible_kv_cache, eq: true}
        - {field: connector.present, eq: true}
    require: {block_compact: true}

# rules/vllm-0.34/connectors/OffloadingConnector.yaml
version: 1
connector: OffloadingConnector
rules:
  - id: offloading-requires-lbhnc
    description: >-
      OffloadingConnector asks for LBHNC (one host transfer per layer and block)
      when HiSparse is off
    reference: >-
      vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py
      OffloadingConnector.get_required_kvcache_layout
    when:
      all:
        - {field: env.VLLM_KV_CACHE_LAYOUT, exists: false}
        - {field: attention.hisparse, eq: false}
    prefer: {layout: LBHNC}
    weight: 10
```

1. Candidates: TRITON_ATTN declares no layouts, so every layout of the
   release is a candidate, in vLLM's default preference order
   (LBNHC, LBHNC, BLNHC, BLHNC, BHLNC, LHBNC).
2. Active scopes: global, and `connector:OffloadingConnector`.
3. No `forbid` or `require` matches (the KV cache is not extensible, the
   groups have one shape, no `VLLM_KV_CACHE_LAYOUT` is set): all six survive.
4. `offloading-requires-lbhnc` matches (`VLLM_KV_CACHE_LAYOUT` is unset and
   `attention.hisparse` is false: vLLM asks the connector only when the
   variable is unset) and adds 10 to LBHNC.
5. LBHNC ranks first with 10; the others tie at 0 in the preference order.
   The decision is **LBHNC** (per_layer, HND), as vLLM 0.34 resolves it.
6. The counterfactuals: LBNHC would be chosen if `env.VLLM_KV_CACHE_LAYOUT`
   were LBNHC; BLHNC if `attention.hisparse` were true.

`kvpolicy dry-run` with no arguments prints exactly this decision and its trace;
`kvpolicy dry-run --vllm-version issue-48412` replays the development state
of vLLM #48412, where `per-token-head-forbids-cross-layer` removes the
cross-layer candidates.
"""

_SEMANTICS = """\
1. **Candidates** come from the release profile (`--vllm-version`,
   `vllm_version=`): the layouts the release has that every attention backend
   supports, most preferred first (vLLM's merged `supported_kv_cache_layouts()`,
   else the release's default preference). The others are removed up front by
   the built-in entry `release-candidates`.
2. **Scopes.** Global rules (files at the top of the rules directory) always
   apply. A connector file's rules apply only while that connector is
   configured; for a composite connector (MultiConnector) each member's file
   applies too, with `connector.*` fields bound to that member.
3. **Removal.** A matched `forbid` removes the candidates its pattern matches;
   a matched `require` removes those it does not match. Removal is final: no
   rule, global or connector, brings a removed candidate back. Rule order and
   file order do not matter. A rule a waiver in force covers where it is
   evaluated has no effect (see Waivers); the explanation says which waiver.
4. **Ranking.** Survivors are ranked by the summed `weight` of matched
   `prefer` rules: global prefers, plus the connector's score, which is its
   own prefers plus its members' scores combined by its `member_preferences`
   (`all`: the smallest member score, so every member must prefer a layout;
   `any`: the largest; `sum`: added; `agree`: the largest, and members whose
   best layouts differ are a conflict). Ties go to `defaults.layout_order`
   when the rule set declares one, else to the candidates' preference order.
5. **Conflict.** If no candidate survives, the decision is an error
   (`NoLayoutError`, exit 1 in the CLI) naming every rule that removed a
   candidate, with its file:line.

A field that has no value here (no connector, an extra key that is not set)
is *absent*: `eq`, `in`, `lt`, `le`, `gt`, `ge` are false on it, `ne` and
`not_in` are true, and `exists: false` tests for it. `eq: true` never matches
the number 1.
"""


# Audit mode (`Rule.enforcement`), with its example: `tests/test_doc_examples.py` runs the dry-run shown.
_AUDIT_MODE = """\
### Audit mode: `enforcement: audit`

A `forbid` or `require` rule with `enforcement: audit` removes nothing. When it matches, the
decision carries a finding that says what enforcing it would remove and what the decision would
become (or that no layout would survive, so vLLM would refuse to start). The finding shows in
`kvpolicy dry-run` (text `warnings:`, JSON `warnings` and `audit`), in the vLLM plugin's log (a
WARNING line), in `kvpolicy lint` (a `note[audit]` with the inputs whose decision enforcing would
change; a note, so `--strict` does not fail on it), in `kvpolicy dry-run --fleet` and in
`kvpolicy inspect`. An audit rule never changes a layout and never blocks start-up: the decision
procedure does not see it (a property test adds random audit rules and checks every decision).

Why a key on `forbid`/`require` and not a fourth effect `warn:`: rolling a rule out is then a
one-line change (delete `enforcement: audit`), the pattern keeps the meaning it will have when
enforced, so the finding can say exactly what enforcing it changes (Kyverno's
`validationFailureAction: Audit`/`Enforce` works the same way, per policy). A `prefer` rule
removes nothing, so `enforcement` on it is an error.

`rollout/global.yaml`, a whole rule file (`docs/examples/rollout/global.yaml`):

```yaml
version: 1
rules:
  # Rolled out in audit mode first: dry-run, lint and the plugin's log say what it would change.
  # Delete the `enforcement: audit` line to enforce it.
  - id: site-per-token-head-stays-nhd
    description: our offload readers expect NHD pages for per-token-head caches
    enforcement: audit
    when: {field: kv.per_token_head, eq: true}
    forbid: {head_order: HND}
```

```
$ kvpolicy dry-run --rules rollout/ --vllm-version 0.34.0 --explain notes
...
layout: LBHNC (per_layer, HND)
...
warnings:
  audit rule `site-per-token-head-stays-nhd` (global, rollout/global.yaml:5) matched;
  enforcing it would remove LBHNC, BLHNC, BHLNC, LHBNC, the chosen LBHNC among them: the
  decision would become LBNHC
...
```

"""


# Waivers (`RuleFile.waivers`, kvpolicy.policy.waivers), with their example: `tests/test_doc_examples.py` runs it.
_WAIVERS = """\
## Waivers

A waiver is an exception to one rule, owned and dated (Kyverno's `PolicyException`, conftest's
exceptions): a global file's `waivers:` list names a rule of any layer by its id, says who answers
for the exception (`owner`), why (`reason`), the last day it applies (`expires`, `YYYY-MM-DD`) and,
optionally, where (`when`, the rules' condition language: `connector.name`, `vllm.profile`,
`kv.kv_cache_dtype`, `backend.name`, ...; absent: wherever the rule applies).

| key | | meaning |
|---|---|---|
{keys}

- **In force** (on or before `expires`), where its `when` holds in the scope the rule is evaluated
  in (a connector rule's `connector.*` fields bind to its connector, for the waiver too), the rule
  has no effect: a `forbid`/`require` removes nothing, a `prefer` adds nothing. The explanation says
  so wherever the rule would have acted: `kvpolicy dry-run` prints a `waived:` section (the rule, what
  it would have removed or preferred, the waiver's file:line, owner, expiry and reason) and marks
  the rule `(waived at file:line)`; the JSON has `waivers` (`applied: true`). The vLLM plugin
  decides with the same code, so it honours waivers the same way.
- **Lapsed** (the day after `expires`): the waiver does not apply, so the rule applies again.
  Every verb that loads the rules warns (`warning[expired-waiver]`, and a line in the decision's
  `warnings`), and `kvpolicy validate` fails (`error[expired-waiver]`, exit 1): a waiver that
  silently lapses changes decisions without a commit, so the CI gate catches it before a deploy;
  renew `expires` after review, or delete the waiver. The day is read once per loaded rule set
  (a decision and its trace always agree; a vLLM process decides its layout once, with the day it
  started): `--today YYYY-MM-DD`, else `KVPOLICY_TODAY`, else the clock's date.
- **Refused**: a waiver of a rule no layer has (`unknown-waived-rule`, with "did you mean"), of an
  audit-mode rule (`waiver-of-audit-rule`: it removes nothing), of the built-in
  `release-candidates` and `backend-geometry` filters (facts, not policy), in a connector file
  (`misplaced-waivers`), and of a shipped guard that `kvpolicy lint` shows load-bearing for safety
  in the release profile (`unwaivable-rule`: e.g. #48412's `per-token-head-forbids-cross-layer`,
  without which the rules let a layout whose views overlap through). Whatever the rules say, the
  geometry verifier refuses a plan whose views overlap before anything is allocated, so no waiver
  can produce a corrupting layout.
- **Shared across releases**: one operator layer often serves deployments of several vLLM releases. A
  waiver of a rule that another release profile's shipped rules have, but this one's do not, is
  `warning[waived-rule-not-in-release]` (it waives nothing here), not an error; a rule no release
  ships stays `unknown-waived-rule`.
- A waiver changes the rule set's digest (a rule set without any keeps its own); `kvpolicy inspect`
  lists the waivers of the rules it shows, in force or expired.

`waivers/global.yaml`, a whole rule file (`docs/examples/waivers/global.yaml`):

```yaml
version: 1
waivers:
  # An exception to a shipped preference, for fp8 caches only: owned, argued, dated.
  - rule: offloading-requires-lbhnc
    owner: kv-team@example.com
    reason: our LMCache 0.3 readers expect NHD pages; INFRA-1234 moves them to HND
    expires: 2027-01-31
    when: {{field: kv.kv_cache_dtype, eq: fp8}}
```

```
{dry_run}
...
layout: LBNHC (per_layer, NHD)
...
waived:
  offloading-requires-lbhnc (prefer, connector:OffloadingConnector) at
  rules/vllm-0.34/connectors/OffloadingConnector.yaml:9 matched and would prefer LBHNC;
  waived at waivers/global.yaml:4 (owner kv-team@example.com, expires 2027-01-31): our
  LMCache 0.3 readers expect NHD pages; INFRA-1234 moves them to HND
...
$ kvpolicy validate waivers/ --vllm-version 0.34.0 --today 2027-02-01
1 expired waiver(s) in rule set `rules/vllm-0.34 + waivers/`
{expired}
  help: review it with its owner: renew `expires`, or delete the waiver
```

"""


_WAIVED_RUN = ("$ kvpolicy dry-run --rules waivers/ --vllm-version 0.34.0 --connector OffloadingConnector "
               "--kv-cache-dtype fp8 --today 2027-01-01 --explain notes")
_EXPIRED = ("waivers/global.yaml:4:5: error[expired-waiver]: the waiver of `offloading-requires-lbhnc` (owner "
            "kv-team@example.com) expired on 2027-01-31: it no longer applies, the rule does again")


def _model_keys(model: type, skip: tuple[str, ...] = ()) -> list[str]:
    rows = []
    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        if name in skip:
            continue
        key = info.alias or name
        required = "required" if info.is_required() else "optional"
        rows.append(f"| `{key}` | {required} | {info.description or ''} |")
    return rows


def _layout_row(lay: Layout) -> str:
    flags = ["yes" if getattr(lay, f"is_{k}") else "no"
             for k in ("layer_compact", "block_outermost", "block_compact", "block_contiguous")]
    legacy = next((name for name, x in LEGACY_NAMES.items() if x is lay), "")
    return (f"| `{lay}` | {lay.stride_order} | `{lay.placement.value}` | `{lay.head_order.value}` | "
            + " | ".join(flags) + f" | {f'`{legacy}`' if legacy else ''} |")


def _profile_row(p: ReleaseProfile) -> str:
    versions = ", ".join(p.vllm_versions) or "a development state"
    rules = " + ".join(f"`rules/{d}/`" for d in p.rules)
    return (f"| `{p.name}` | {versions} | {', '.join(f'`{x}`' for x in p.layouts)} | "
            f"{', '.join(f'`{b}`' for b in p.backends)} | {p.default_block_size} | {rules} |")


def render_reference() -> str:
    """The full rule-language reference as Markdown."""
    out = [
        "# The kvpolicy rule language",
        "",
        "<!-- generated by `python -m kvpolicy.policy.reference`; do not edit by hand -->",
        "",
        "Rules are YAML files in a rules directory: `*.yaml` at the top are global,",
        "`connectors/*.yaml` apply while the connector they name is configured, and",
        "`tests/*.yaml` hold policy tests (`kvpolicy test`). Editors validate and",
        "complete rule files with the JSON Schema `kvpolicy schema` prints (`docs/rule-file.schema.json`",
        "in a checkout): `kvpolicy schema > rule-file.schema.json` beside your rules, then start a file",
        "with `# yaml-language-server: $schema=./rule-file.schema.json` (relative to the rule file).",
        "",
        "A connector file may name any connector class (`connector: MyConnector`, a",
        "third-party or newer vLLM connector): a well-formed name is a Python class name",
        "(ASCII letters, digits, `_`, not starting with a digit, at most 128 characters).",
        "A name no release profile knows that is close to a known one or to another",
        "file's (`NixlConector`) is a warning with \"did you mean\"; `kvpolicy lint` lists",
        "the connectors no profile knows.",
        "",
        "An operator's directories are layered on the shipped rules of the selected",
        "release profile (`--rules A --rules B`: shipped, A, B): forbids of every layer",
        "apply, rule ids are unique across layers, and replacing the shipped rules is",
        "explicit (`--no-shipped-rules`). See [rule-layers.md](rule-layers.md). The one",
        "exception is a waiver: owned, dated, shown in every explanation (see Waivers).",
        "",
        "## Decision semantics",
        "",
        _SEMANTICS,
        "## File",
        "",
        "| key | | meaning |",
        "|---|---|---|",
        *_model_keys(RuleFile),
        "",
        f"`member_preferences` is one of {', '.join(f'`{m.value}`' for m in MemberPreferences)}.",
        "",
        "`defaults`:",
        "",
        "| key | | meaning |",
        "|---|---|---|",
        *_model_keys(Defaults),
        "",
        "## Rule",
        "",
        "| key | | meaning |",
        "|---|---|---|",
        *_model_keys(Rule),
        "",
        "A rule has exactly one effect:",
        "",
        "| effect | meaning |",
        "|---|---|",
        "| `forbid: <pattern>` | remove every candidate the pattern matches |",
        "| `require: <pattern>` | remove every candidate the pattern does not match |",
        "| `prefer: <pattern>` | add `weight` (default 1, at most 1000) to every candidate the pattern matches |",
        "",
        "A pattern is a mapping; every key given must hold, an absent key matches any value.",
        "",
        "| key | | meaning |",
        "|---|---|---|",
        *_model_keys(LayoutPattern),
        "",
        f"`placement` is one of {', '.join(f'`{p.value}`' for p in Placement)}; "
        f"`head_order` one of {', '.join(f'`{h.value}`' for h in HeadOrder)}.",
        "",
        *_AUDIT_MODE.splitlines(),
        *_WAIVERS.format(keys="\n".join(_model_keys(Waiver)), dry_run=_WAIVED_RUN, expired=_EXPIRED).splitlines(),
        "## Layouts",
        "",
        "vLLM's `KVCacheLayout`s: each name spells the physical order of the logical",
        "`[L, B, H, N, C]` dims (layers, blocks, KV heads, tokens of a block, cell bytes),",
        "outermost first. The releases before 0.29 named four of them",
        "`placement/head_order`; those names still parse.",
        "",
        "| layout | stride order | placement | head_order | layer_compact | block_outermost | block_compact "
        "| block_contiguous | legacy name |",
        "|---|---|---|---|---|---|---|---|---|",
        *(_layout_row(lay) for lay in ALL_LAYOUTS),
        "",
        "## Conditions",
        "",
        "`when` is a tree; there are no expression strings.",
        "",
        "| node | meaning |",
        "|---|---|",
        "| `all: [<condition>, ...]` | true when every condition is |",
        "| `any: [<condition>, ...]` | true when some condition is |",
        "| `not: <condition>` | true when the condition is false |",
        "| `{field: <path>, <op>: <value>}` | a leaf: exactly one operator |",
        "",
        "| operator | meaning |",
        "|---|---|",
        *(f"| `{op}` | {meaning} |" for op, meaning in OPERATORS.items()),
        "",
        "`in` and `not_in` take a list. `lt`, `le`, `gt`, `ge` apply to integer fields and",
        "connector extras only. Values are checked against the field's type when the",
        "rules load: a string for an integer field, or an unknown enum value, is an error.",
        "A boolean is never an integer (`eq: true` on `kv.block_size` is an error, not a rule",
        "that never matches), and integers lie within 64 bits.",
        "",
        "YAML 1.1 reads some plain values as something else; these are errors with a hint,",
        "never silent: `1:30` (base 60, read as 90) and `017` (octal, read as 15) are refused",
        "(quote them, or write the decimal); `version: true` is not `version: 1`; `yes`, `no`,",
        "`on`, `off` are booleans where a value is expected (quote them for text), while",
        "a key such as `on:` keeps its text. Tags other than the plain ones (`!!int abc`,",
        "`!!timestamp`, `!!set`, `!!python/...`) are located errors.",
        "",
        "## Field paths",
        "",
        "| path | type | meaning |",
        "|---|---|---|",
        *(f"| `{f.path}` | {f.type_label} | {f.description} |" for f in FIELDS.values()),
        f"| `{EXTRA_PREFIX}<key>` | string, number or boolean (may be absent) | a key of vLLM's "
        "`kv_connector_extra_config` |",
        "",
        "`kv.*` describe the first attention KV cache group. `kv.kv_cache_dtype` takes the",
        "strings the selected release accepts (below).",
        "",
        "## Release profiles",
        "",
        "What kvpolicy knows about each vLLM release (`policy/releases/<profile>.yaml`),",
        "checked against the installed release by `tests/conformance/`:",
        "",
        "| profile | vLLM | layouts | attention backends | default block size | shipped rules |",
        "|---|---|---|---|---|---|",
        *(_profile_row(p) for p in iter_profiles()),
        "",
        *(line for p in iter_profiles() for line in (
            f"`{p.name}` `kv_cache_dtype`s: " + ", ".join(f"`{d}`" for d in p.kv_cache_dtypes) + ".", "")),
        "## Worked example",
        "",
        _WORKED_EXAMPLE,
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(render_reference(), end="")
