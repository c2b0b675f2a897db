"""A rule file the docs show under its file name is a whole file an operator can copy and load.

An operator copies a YAML block the docs present as `rollout/global.yaml` into that file and runs
`kvpolicy validate`; a fragment there (a bare list of rules, no `version: 1`) fails on the first try.
A block is named either by a first line that is only a comment with a path (`# rollout/global.yaml`)
or by the line before it naming the example file it is (`docs/examples/rollout/global.yaml`): the
first kind must load as a rule file, the second must be that file, word for word.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_HEADER = re.compile(r"^# (?P<path>[\w./-]+\.ya?ml)\s*$")
_EXAMPLE = re.compile(r"`(?P<path>docs/examples/[\w./-]+\.ya?ml)`")


def _yaml_blocks() -> list[tuple[str, str, str]]:
    """(where, the line before the block, the block's text) for every ```yaml block of the docs."""
    out = []
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "```yaml":
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            out.append((f"{doc.relative_to(ROOT)}:{i + 1}", before, "\n".join(lines[i + 1:end]) + "\n"))
    return out


BLOCKS = _yaml_blocks()
NAMED = [(w, m["path"], t) for w, _, t in BLOCKS if t.strip() and (m := _HEADER.match(t.splitlines()[0]))]
EXAMPLES = [(w, m["path"], t) for w, before, t in BLOCKS if (m := _EXAMPLE.search(before))]


def test_a_block_named_as_a_rule_file_loads_as_one(tmp_path: Path) -> None:
    failed = []
    for n, (where, path, text) in enumerate(NAMED):
        file = tmp_path / str(n) / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text, encoding="utf-8")
        done = subprocess.run([sys.executable, "-m", "kvpolicy", "validate", str(file), "--vllm-version", "0.34.0",
                               "--today", "2027-01-01"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        if done.returncode != 0:
            failed.append(f"{where}: `{path}` as the docs show it does not load:\n{done.stderr}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize(("where", "path", "text"), EXAMPLES, ids=[w for w, _, _ in EXAMPLES])
def test_a_block_naming_an_example_file_is_that_file(where: str, path: str, text: str) -> None:
    assert (ROOT / path).read_text(encoding="utf-8") == text, f"{where} differs from {path}"


def test_the_rule_language_shows_its_example_files_whole() -> None:
    """The rollout and waiver examples of docs/rule-language.md are the example files, whole."""
    shown = {path for _, path, _ in EXAMPLES}
    assert {"docs/examples/rollout/global.yaml", "docs/examples/waivers/global.yaml"} <= shown


FLEETS = [(w, t) for w, _, t in BLOCKS if re.search(r"^deployments:", t, re.M) and t.startswith("version: 1")]


@pytest.mark.parametrize(("where", "text"), FLEETS, ids=[w for w, _ in FLEETS])
def test_a_fleet_file_the_docs_show_decides_beside_the_example_models(where: str, text: str, tmp_path: Path) -> None:
    """Copied next to docs/examples/fleet.yaml (outside the checkout), a fleet file the docs show decides:
    its `model:` paths name the example models, not files only a checkout has."""
    import shutil

    shutil.copytree(ROOT / "docs" / "examples", tmp_path / "examples")
    (tmp_path / "examples" / "mine.yaml").write_text(text, encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "kvpolicy", "dry-run", "--fleet", "mine.yaml"],
                          capture_output=True, text=True, cwd=tmp_path / "examples", timeout=120)
    assert done.returncode == 0, f"{where}: the fleet file as the docs show it does not decide:\n{done.stderr}"
