"""`kvpolicy lint` cost as the rule set grows, as ratios measured in one run (issue #15).

- ``lint_1000_vs_shipped``: `lint` of the 1,000 generated rules of
  ``bench_decide.generated_rules`` (connector rules on ``kv.block_size gt 64``,
  ``kv.num_layers ge 200``, dtypes, backends, group counts) against `lint` of the
  shipped rules, same profile, same process. The space now reaches each size
  literal, so this grows with the distinct literals, not with the rule count.
- ``lint_extras9_vs_extras3``: a connector file whose rules test 9
  ``connector.extra.*`` keys (each alone, plus pairs in one condition) against
  one testing 3: with one key varied at a time, about 3x, not 3^6 = 729x.

Seconds and space sizes are printed for the record (bench/README.md); they depend
on the machine, the ratios much less.

    python bench/bench_lint.py [--quick] [--profile NAME]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def extras_rules(keys: int) -> dict[str, str]:
    """A connector file testing ``keys`` extra keys: each alone, and neighbours together."""
    body = ""
    for i in range(keys):
        op, value = (("lt", 4), ("eq", '"on"'), ("in", "[1, 2]"))[i % 3]
        body += (f"  - id: k{i}\n    description: extra key {i}\n"
                 f"    when: {{field: connector.extra.k{i}, {op}: {value}}}\n    prefer: {{layout: per_layer/HND}}\n")
    for i in range(0, keys - 1, 2):
        body += (f"  - id: pair{i}\n    description: keys {i} and {i + 1} together\n"
                 f"    when: {{all: [{{field: connector.extra.k{i}, exists: true}}, "
                 f"{{field: connector.extra.k{i + 1}, exists: false}}]}}\n    forbid: {{placement: cross_layer}}\n")
    return {"connectors/nixl.yaml": f"version: 1\nconnector: NixlConnector\nrules:\n{body}"}


def _time(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(quick: bool = False, profile: str | None = None) -> dict[str, float]:
    from bench_decide import PROFILE, generated_rules

    from kvpolicy.engine import LayoutEngine
    from kvpolicy.engine.analysis import lint
    from kvpolicy.policy import load_rules_from_texts

    prof = profile or PROFILE
    runs = 1 if quick else 3
    big = load_rules_from_texts(generated_rules())
    shipped = LayoutEngine.default(prof).ruleset
    ex3, ex9 = (load_rules_from_texts(extras_rules(k)) for k in (3, 9))
    out: dict[str, float] = {}
    for name, rs in (("1000", big), ("shipped", shipped), ("extras3", ex3), ("extras9", ex9)):
        report = lint(rs, vllm_version=prof)
        out[f"lint_{name}_inputs"] = report.inputs_checked
        out[f"lint_{name}_dead"] = sum(1 for f in report.findings if f.code == "dead-rule")
        out[f"lint_{name}_cut"] = int(report.space is not None and report.space.cut is not None)  # over --max-space
        out[f"lint_{name}_s"] = _time(lambda rs=rs: lint(rs, vllm_version=prof), runs)
    out["lint_1000_vs_shipped"] = out["lint_1000_s"] / out["lint_shipped_s"]
    out["lint_extras9_vs_extras3"] = out["lint_extras9_s"] / out["lint_extras3_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", default=None)
    args = parser.parse_args()
    for key, value in run(args.quick, args.profile).items():
        print(f"{key:<28} {value:.3f}" if isinstance(value, float) else f"{key:<28} {value}")


if __name__ == "__main__":
    main()
