# ruff: noqa  (hostile-pass scripts, not product code)
"""Class 8: a test reviewer's reading of tests/conformance/*.py for comparisons that pass without comparing
(loops that may be empty, counts without a minimum, refusals equal by construction, loose matches).
Each finding is pinned to the source line it quotes, so the script says STALE when the code moved on.
Run: python hostile/class8_conformance_review.py"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import report, summary

ROOT = Path(__file__).resolve().parents[2] / "tests" / "conformance"

# (file, a line's text, held?, what a reviewer says)
REVIEW = [
    # ---- broke: pass without comparing
    ("test_v034_plugin.py", 'if "error" in vllm or "error" in plugin:', False,
     "out-of-tree connectors under 0.34: any vLLM error and any plugin error count as `refused by both` (the "
     "issue's own example; test_gate_plugin.py's twin now uses _same_refusal, this one still does not look at "
     "either error)"),
    ("test_gate_decisions.py", 'ours, theirs = ours[:1] == "B", answer["uniform"]', False,
     "mamba_only deployments: kvpolicy's refusal ('error'[:1] != 'B', so False) equals vLLM's per-layer answer "
     "(uniform False): a refusal is counted as an agreeing layout"),
    ("test_v034_geometry.py", 'tally.check(key, "refusal", exc.diagnostics[0].code, "unpaddable-layout")', False,
     "refused alike: kvpolicy's code is compared with a constant; vLLM's error (result['error']) is never read, "
     "so any vLLM failure agrees with kvpolicy's unpaddable-layout"),
    ("test_v034_decisions.py", '("ValueError: VLLM_KV_CACHE_LAYOUT=", NoLayoutError, "env-layout-"),', False,
     "VLLM_KV_CACHE_LAYOUT refusals: the marker `env-layout-` is matched as a substring of any blamed rule id "
     "(compare(), `any(marker in b ...)`), so blaming env-layout-blnhc agrees with vLLM refusing "
     "VLLM_KV_CACHE_LAYOUT=BHLNC; the layout in vLLM's message is not compared"),
    ("test_v034_decisions.py", 'if warned != bool(ours.get("warnings")):', False,
     "vLLM's specific warning (the connector's layout is not a candidate) is compared with `kvpolicy warned "
     "anything`: any other kvpolicy warning passes for it"),
    ("test_v034_decisions.py", "if not release.has_spec_set(specs):", False,
     "the unbuildable-spec loop in test_decisions_equal_vllms may skip every item (no count, no minimum of "
     "refusals checked)"),
    ("test_v034_plugin.py", 'elif "error" not in vllm:', False,
     "rules written from scratch: a plugin refusal that is not [vllm-requirement] where vLLM also refused is "
     "not compared at all (no branch checks it); `before` cases are skipped uncounted"),
    ("test_v034_plugin.py", 'for answer in run["by"]["off-decide"]:', False,
     "plugin unset: loop without a minimum (may be empty)"),
    ("test_resolver_plugin.py", 'for answer in run["by"]["off-decide"]:', False,
     "plugin unset (0.29-0.33): loop without a minimum (space[::2000], may be empty)"),
    ("test_gate_plugin.py", 'for answer in run["by"]["off-gate"]:', False,
     "plugin unset (0.24-0.28): loop without a minimum"),
    ("test_resolver_plugin.py", 'elif "layout" not in expected:', False,
     "engine core: a case where the rules decide a layout but nothing was distributed is checked by neither "
     "branch (only `distributed >= 10` overall)"),
    ("test_gate_plugin.py", 'if "head-order-fixed" not in plugin["error"] and "no KV cache layout survives" not in plugin["error"]:', False,
     "scratch rules (0.24-0.28): where vLLM's gate answered, any plugin refusal saying `no KV cache layout "
     "survives` passes, whichever rule it names"),
    ("test_gate_plugin.py", 'assert "error" in plugin or plugin["uniform"] is False, (d.label(), plugin)', False,
     "site phases, mamba_only: any plugin error passes (a refusal accepted as the per-layer answer)"),
    # ---- held: the class-8 fixes, read and found comparing
    ("test_gate_decisions.py", "if (why := _same_refusal(answer, blamed, also)) is not None:", True,
     "gate decisions: two refusals agree only when kvpolicy names the rule vLLM's error maps to"),
    ("test_gate_decisions.py", 'assert equal - refusals >= len(pairs) // 2, "fewer than half the deployments compare layouts"', True,
     "gate decisions: at least half the deployments compare layouts"),
    ("test_v034_decisions.py", "assert layouts >= len(cases) // 4, (layouts, refusals)", True,
     "resolver decisions: a quarter of the cases compare layouts; layouts and refusals printed apart"),
    ("test_v034_decisions.py", "if ours[\"error\"] != cls.__name__:", True,
     "resolver decisions: a refusal must be the mapped error class, naming the mapped rule"),
    ("test_v034_plugin.py", "assert layouts >= len(space) // 4, dict(outcomes)  # the agreement is on layouts, not only on refusals", True,
     "0.34 plugin: minimum of resolved layouts; refusals before resolution reported apart, never counted"),
    ("test_resolver_plugin.py", "assert layouts >= len(cases) // 4, dict(outcomes)  # the agreement is on layouts, not only on refusals", True,
     "0.29-0.33 plugin: minimum of resolved layouts"),
    ("test_gate_plugin.py", "why = _same_refusal(vllm, plugin)", True,
     "0.24-0.28 out-of-tree connectors: refusals compared"),
    ("test_gate_plugin.py", 'assert compared - seen["the same refusal"] >= len(space) // 2, dict(seen)', True,
     "0.24-0.28 plugin: half the sample compares answers, not refusals"),
    ("test_cells.py", "assert set(rows) == set(ASKED) and total[0] + len(REFUSED) == len(CASES)", True,
     "test_figures: recomputed from the cached comparisons, every case compared or refused as vLLM refuses"),
    ("test_v034_geometry.py", "assert agree == made", True, "geometry: every comparison made agrees, made > 0"),
    ("test_cpu_platform.py", "assert checked == len(cases)", True, "CPU platform: every case checked"),
    ("test_gate_geometry.py", 'failures.append(f"{key} {case[\'head_order\']}: vLLM refused: {answer[\'error\']}")', True,
     "gate geometry: a vLLM refusal is a failure, never an agreement"),
]


def main() -> None:
    for fname, text, held, why in REVIEW:
        lines = (ROOT / fname).read_text().splitlines()
        at = [i + 1 for i, line in enumerate(lines) if text in line]
        if not at:
            report(f"c8/{fname}:STALE", True, f"the quoted line is gone (the code changed): {text[:70]!r}")
            continue
        report(f"c8/tests/conformance/{fname}:{at[0]}", held, why, f"sed -n {max(1, at[0] - 3)},{at[0] + 3}p "
               f"tests/conformance/{fname}")
    summary("8")


if __name__ == "__main__":
    main()
