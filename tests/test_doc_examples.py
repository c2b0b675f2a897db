"""Every example in README.md and docs/*.md runs, so the docs cannot drift from the code.

- ``$ kvpolicy ...`` lines in any fenced block are run; the lines after them, up to the
  next ``$`` or the end of the block, are the output they must print (stdout and stderr
  together). A line ``...`` stands for any number of lines, ``...`` inside a line for any
  text; timings (``0.10s``) are not compared. Shown lines must otherwise appear in order,
  adjacent where the doc shows them adjacent.
- Lines starting with ``kvpolicy `` (or ``python -m kvpolicy``) in ``sh`` blocks are run;
  they must exit 0 or 1 (1: the documented "no" of a verb) without a traceback.
- ``python`` blocks run, in a fresh interpreter per document, in order, sharing names.
- A block preceded by ``<!-- not-run: reason -->`` is skipped, and the reason is
  required; `NOT_RUN` pins how many there are, so the list stays short.

Everything runs in a scratch directory holding what the examples name: the repository's
``rules/``, ``tests/`` and ``docs/``, ``spec.yaml`` (a 4-layer KV spec), ``config.json``
and ``Qwen2.5-0.5B/config.json`` (Qwen2.5-0.5B's Hugging Face config), and ``my-rules/``
(the ``issue-48412`` shipped rules without the per-token-head guard), under the default
release profile (no ``KVPOLICY_VLLM_VERSION``, no vLLM installed).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = 5  # blocks marked <!-- not-run: ... -->, all documents together

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
_NOT_RUN = re.compile(r"<!--\s*not-run:\s*(?P<reason>\S.*?)\s*-->")
_TIMING = re.compile(r"\b\d+(\.\d+)?s\b")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    not_run: str | None

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = len(m["indent"]), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = _NOT_RUN.search(before)
        out.append(Block(doc, start + 1, m["lang"], "\n".join(body), marker["reason"] if marker else None))
        i += 1
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]


def _commands(block: Block) -> list[tuple[str, list[str] | None]]:
    """(command, expected output lines or None) pairs of a block; continuation lines joined."""
    out: list[tuple[str, list[str] | None]] = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        prompt = line.startswith("$ ")
        plain = block.lang in ("sh", "bash", "shell") and re.match(r"(kvpolicy|python3? -m kvpolicy)\b", line)
        if not (prompt or plain):
            i += 1
            continue
        cmd = line[2:] if prompt else line
        while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        expected = None
        if prompt:
            expected = []
            while i < len(lines) and not lines[i].startswith("$ "):
                expected.append(lines[i])
                i += 1
            while expected and not expected[-1].strip():
                expected.pop()
        out.append((cmd, expected))
    return out


def _line_matches(shown: str, actual: str) -> bool:
    shown, actual = _TIMING.sub("<t>", shown.rstrip()), _TIMING.sub("<t>", actual.rstrip())
    if "..." not in shown:
        return shown == actual
    pattern = ".*".join(re.escape(part) for part in shown.split("..."))
    return re.fullmatch(pattern, actual) is not None


def output_matches(shown: list[str], actual: list[str]) -> str | None:
    """None when ``actual`` shows ``shown`` (see the module docstring), else what is missing."""

    def match(s: int, a: int, gap: bool) -> bool:
        if s == len(shown):
            return True
        if shown[s].strip() == "...":
            return match(s + 1, a, True)
        for k in range(a, len(actual) if gap else min(a + 1, len(actual))):
            if _line_matches(shown[s], actual[k]) and match(s + 1, k + 1, False):
                return True
        return False

    if match(0, 0, False):
        return None
    return "the output does not show these lines (in this order):\n" + "\n".join(shown)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    box = tmp_path_factory.mktemp("docs")
    for name in ("rules", "tests", "docs"):
        (box / name).symlink_to(ROOT / name)
    (box / "spec.yaml").write_text("num_layers: 4\nblock_size: 16\nnum_kv_heads: 2\nhead_size: 64\n")
    config = ROOT / "tests" / "fixtures" / "configs" / "qwen2.5-0.5b.json"
    shutil.copy(config, box / "config.json")
    (box / "Qwen2.5-0.5B").mkdir()
    shutil.copy(config, box / "Qwen2.5-0.5B" / "config.json")
    shutil.copytree(ROOT / "rules" / "issue-48412", box / "my-rules")
    text = (box / "my-rules" / "global.yaml").read_text()
    start = text.index("  - id: per-token-head-forbids-cross-layer")
    end = text.index("  - id: cross-layer-needs-block-stride-indexing")
    (box / "my-rules" / "global.yaml").write_text(text[:start] + text[end:])
    return box


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVPOLICY_VLLM_VERSION"}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["COLUMNS"] = "200"
    return env


def _run(cmd: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``cmd`` under bash; ``kvpolicy`` is this interpreter's, and ``| jq PATH`` is read by Python (jq
    need not be installed): the output must be JSON with that path."""
    jq = None
    if "| jq " in cmd:
        cmd, jq = (part.strip() for part in cmd.split("| jq ", 1))
    cmd = re.sub(r"^kvpolicy\b", shlex.quote(sys.executable) + " -m kvpolicy", cmd)
    cmd = re.sub(r"^python3? -m kvpolicy\b", shlex.quote(sys.executable) + " -m kvpolicy", cmd)
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=cwd, env=_env(), timeout=120)
    if jq is not None and proc.returncode in (0, 1):
        data = json.loads(proc.stdout)
        for key in jq.split()[0].strip("'\"").strip(".").split("."):
            assert key in data, f"`jq .{key}`: no such key in the output"
            data = data[key]
    return proc


RUNNABLE = [b for b in ALL if b.not_run is None and (b.lang == "python" or _commands(b))]


def test_the_harness_sees_the_examples() -> None:
    assert len(RUNNABLE) >= 15
    assert sum(1 for b in RUNNABLE if b.lang == "python") >= 3
    assert sum(1 for b in ALL if b.not_run is not None) == NOT_RUN, [b.where for b in ALL if b.not_run]


def test_the_output_matcher() -> None:
    actual = ["a", "b", "c 0.12s", "d x y"]
    assert output_matches(["a", "...", "d x ..."], actual) is None
    assert output_matches(["b", "c 3.5s"], actual) is not None  # must start where the output starts
    assert output_matches(["...", "b", "c 3.5s"], actual) is None
    assert output_matches(["a", "c 0.12s"], actual) is not None  # adjacent as shown
    assert output_matches(["a", "...", "e"], actual) is not None


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.lang != "python"], ids=lambda b: b.where)
def test_shell_example(block: Block, sandbox: Path) -> None:
    for cmd, expected in _commands(block):
        proc = _run(cmd, sandbox)
        output = proc.stdout + proc.stderr
        assert "Traceback" not in output, f"{block.where}: `{cmd}`\n{output[-3000:]}"
        assert proc.returncode in (0, 1), f"{block.where}: `{cmd}` exited {proc.returncode}\n{output[-3000:]}"
        if expected:  # stdout and stderr interleave on a terminal: either order may be the one shown
            problems = [output_matches(expected, (a + b).splitlines())
                        for a, b in ((proc.stdout, proc.stderr), (proc.stderr, proc.stdout))]
            assert None in problems, f"{block.where}: `{cmd}`: {problems[0]}\n--- actual:\n{output[-6000:]}"


@pytest.mark.parametrize("doc", sorted({b.doc for b in RUNNABLE if b.lang == "python"}),
                         ids=lambda d: str(d.relative_to(ROOT)))
def test_python_examples(doc: Path, sandbox: Path) -> None:
    snippets = [b for b in RUNNABLE if b.doc == doc and b.lang == "python"]
    program = "\n".join(f"# {b.where}\nexec(compile({b.text!r}, {b.where!r}, 'exec'))" for b in snippets)
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=sandbox, env=_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _json_blocks(doc: str) -> list[Block]:
    return [b for b in ALL if b.doc == ROOT / "docs" / doc and b.lang == "json"]


def test_json_output_samples_are_the_real_documents(sandbox: Path) -> None:
    """docs/json-output.md's dry-run sample has the real top-level keys in the real order, and its
    validate sample is the shipped rules' document, digest included."""
    dry, valid = _json_blocks("json-output.md")[:2]
    shown = re.findall(r'^  "(\w+)":', dry.text, flags=re.M)
    proc = _run("kvpolicy dry-run --format json --vllm-version 0.34.0 --block-size 16", sandbox)
    assert list(json.loads(proc.stdout)) == shown, dry.where
    proc = _run("kvpolicy validate --format json", sandbox)
    assert json.loads(proc.stdout) == json.loads(valid.text), valid.where


def test_the_fingerprint_example_digest_is_its_json() -> None:
    import hashlib

    (block,) = _json_blocks("fingerprint.md")
    canonical = json.dumps(json.loads(block.text), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    text = (ROOT / "docs" / "fingerprint.md").read_text()
    after = text[text.index(block.text) + len(block.text):]
    stated = re.search(r"with digest\s+`(sha256:[0-9a-f]{64})`", after)
    assert stated is not None and stated[1] == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = [b for b in ALL if b.doc == ROOT / "README.md" and b.lang == "sh"]
    test_command = next(b.text.strip() for b in readme if "pytest" in b.text)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == test_command
    install = next(b.text.strip() for b in readme if "kvpolicy dry-run" in b.text)
    assert 'pip install -q -e ".[torch]"' in install and "torch==2.13.0" in install


def _table_keys(doc: str, heading: str) -> set[str]:
    """The keys a docs table lists (first column, backticked; `a`, `b` rows give both) under ``heading``."""
    text = (ROOT / "docs" / doc).read_text()
    section = text[text.index(heading) + len(heading):]
    section = section[:re.search(r"^#", section, flags=re.M).start()] if re.search(r"^#", section, flags=re.M) \
        else section
    return {key for cell in re.findall(r"^\| ([^|]+) \|", section, flags=re.M) for key in re.findall(r"`(\w+)`", cell)}


def test_json_output_tables_name_every_key_of_the_real_documents(sandbox: Path) -> None:
    """Each table of docs/json-output.md lists exactly the keys its document carries: a key added, renamed or
    dropped in `to_dict` (the plan's, the allocation's, the context's) fails here until the docs say it."""
    proc = _run("kvpolicy dry-run --format json --vllm-version 0.34.0 --num-blocks 4 --connector NixlConnector "
                "--map", sandbox)
    out = json.loads(proc.stdout)
    optional = {"plan_error", "vllm_version"}  # a refusal's key; the profile's release
    assert _table_keys("json-output.md", "### Top-level keys") - optional <= set(out) <= \
        _table_keys("json-output.md", "### Top-level keys")
    assert set(out["plan"]) == _table_keys("json-output.md", "### `plan` (with `--num-blocks N`)")
    assert set(out["allocation"]) == _table_keys("json-output.md", "### `allocation`")
    inputs = _table_keys("json-output.md", "#### `inputs`")
    assert set(out["inputs"]) <= inputs and inputs - set(out["inputs"]) == {"worker_backends"}
