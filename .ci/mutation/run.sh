#!/usr/bin/env bash
# Mutation testing (mutmut 3) over policy/ and the decision, verify and runtime modules.
#
#   .ci/mutation/run.sh VENV [STAGE_DIR] [-- mutmut run args]
#   MUTATION_SAMPLE=N .ci/mutation/run.sh ...   test a seeded random sample of N mutants
#                                              (MUTATION_SEED, default 0; MUTATION_ONLY, a regex on names)
#   MUTATION_FILES='engine/verify.py ...'        mutate only these files (default: the scope below)
#   MUTATION_TESTS='tests/engine/test_verify.py ...'   run only these tests (default: the unit suite)
#
# VENV: a venv with torch, the test extras and mutmut, and kvpolicy NOT installed
#   (python3 -m venv V && V/bin/pip install torch==2.13.0 pydantic PyYAML pytest pytest-xdist hypothesis jsonschema
#   mutmut). mutmut runs the tests in its own process: -n0 (pyproject.toml asks for pytest-xdist workers).
# The repo is copied to STAGE_DIR (default /tmp/kvpolicy-mutation); mutmut works there.
# Two adaptations, both confined to VENV: an import map (kvpolicy_srcmap.py) so that
# `kvpolicy.policy` is mutants/policy, and mutmut's trampoline told that a function of
# `kvpolicy.policy.x` is the mutant of file policy/x.py (mutmut names mutants by path).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$(cd "$1" && pwd)"; shift
STAGE="${1:-/tmp/kvpolicy-mutation}"; [ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
PY="$VENV/bin/python"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$ROOT/.ci/mutation/kvpolicy_srcmap.py" "$SITE/" && echo "import kvpolicy_srcmap" > "$SITE/kvpolicy_srcmap.pth"
TRAMP="$SITE/mutmut/mutation/trampoline.py"
grep -q "removeprefix('kvpolicy.')" "$TRAMP" || sed -i 's/\(orig_func\|decorated_func\)\.__module__/\1.__module__.removeprefix('"'"'kvpolicy.'"'"')/g' "$TRAMP"
# mutmut hands node ids back to pytest, which cannot find an id whose parameters it escaped
# (non-ASCII text, newlines): such ids select their whole test function instead
HARNESS="$SITE/mutmut/runners/harness.py"
grep -q "kvpolicy: escaped ids" "$HARNESS" || "$PY" - "$HARNESS" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
old = "            pytest_args += list(tests)\n"
new = ("            # kvpolicy: escaped ids select their whole function\n"
       "            pytest_args += list(dict.fromkeys(t if t.isascii() and '\\\\' not in t else t.split('[', 1)[0]\n"
       "                                              for t in tests))\n")
assert old in text, "mutmut's harness changed: update .ci/mutation/run.sh"
open(path, "w").write(text.replace(old, new))
PY
rm -rf "$STAGE" && mkdir -p "$STAGE"
(cd "$ROOT" && git ls-files -z | xargs -0 cp --parents -t "$STAGE")
cat >> "$STAGE/pyproject.toml" <<'TOML'

[tool.mutmut]
source_paths = ["kvpolicy", "policy", "engine", "rules"]
only_mutate = @ONLY@
do_not_mutate = ["policy/reference.py"]
also_copy = ["tests", "docs", "bench", "README.md", "pyproject.toml"]
pytest_add_cli_args_test_selection = @TESTS@
# not about behaviour under mutation: ruff over the instrumented tree, the console script (alone or run by a
# shell from a printed command), the wheel;
# and a logging test that passes alone but not after mutmut's in-process harness has set up logging
pytest_add_cli_args = ["-n0", "--ignore=tests/conformance", "--ignore=tests/test_packaging.py", "-p", "no:cacheprovider",
                       "--deselect=tests/test_docs_and_api.py::test_ruff_clean",
                       "--deselect=tests/cli/test_cli_main.py::test_console_script", "--ignore=tests/test_doc_examples.py",
                       "--deselect=tests/cli/test_cli_record_roundtrip.py::test_the_printed_command_runs_in_a_shell_and_names_the_rules",
                       "--deselect=tests/engine/integrations/test_vllm_plugin.py::test_the_decision_log_line_is_written_once"]
TOML
set -f  # the scope is fnmatch patterns, not globs of this directory
toml_list() { "$PY" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@"; }
ONLY="$(toml_list ${MUTATION_FILES:-policy/*.py engine/decide.py engine/verify.py engine/lattice.py engine/runtime/*.py})"
TESTS="$(toml_list ${MUTATION_TESTS:-tests/})"
set +f
"$PY" - "$STAGE/pyproject.toml" "$ONLY" "$TESTS" <<'PY'
import sys
path, only, tests = sys.argv[1:]
text = open(path).read().replace("@ONLY@", only).replace("@TESTS@", tests)
open(path, "w").write(text)
PY
cd "$STAGE"
export KVMUT_SRC_ROOT="$STAGE/mutants"
if [ -n "${MUTATION_SAMPLE:-}" ]; then
  # generate the mutants and the per-test stats (cached in mutants/), testing none of them
  "$VENV/bin/mutmut" run "$@" "policy.reference.no_such_mutant" || true
  mapfile -t NAMES < <("$PY" - <<'PY'
import os, random, re
from pathlib import Path
names = []
for path in sorted(Path("mutants").rglob("*.py")):
    module = ".".join(path.relative_to("mutants").with_suffix("").parts).removesuffix(".__init__")
    for m in re.finditer(r"^\s*def (x[^\s(]*__mutmut_\d+)\(", path.read_text(encoding="utf-8"), re.M):
        names.append(f"{module}.{m.group(1)}")
only = os.environ.get("MUTATION_ONLY")
names = sorted(n for n in names if not only or re.search(only, n))
random.Random(int(os.environ.get("MUTATION_SEED", "0"))).shuffle(names)
print("\n".join(sorted(names[: int(os.environ["MUTATION_SAMPLE"])])))
PY
)
  echo "sampled ${#NAMES[@]} mutants" >&2
  printf '%s\n' "${NAMES[@]}" > sample.txt
  "$VENV/bin/mutmut" run "$@" "${NAMES[@]}"
else
  "$VENV/bin/mutmut" run "$@"
fi
"$VENV/bin/mutmut" results --all true > results.txt || true
echo "results: $STAGE/results.txt"
