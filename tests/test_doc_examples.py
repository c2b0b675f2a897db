"""Every example in README.md, docs/*.md and every ``--help`` runs, from a directory outside the checkout,
so the docs cannot drift from the code and a new user's first commands work.

- ``$ kvpolicy ...`` lines in any fenced block are run; the lines after them, up to the
  next ``$`` or the end of the block, are the output they must print (stdout and stderr
  together). A line ``...`` stands for any number of lines, ``...`` inside a line for any
  text; timings (``0.10s``) are not compared. Shown lines must otherwise appear in order,
  adjacent where the doc shows them adjacent.
- Lines starting with ``kvpolicy `` (or ``python -m kvpolicy``, or ``VAR=value kvpolicy``) in
  ``sh`` blocks are run; they must exit 0 or 1 (1: the documented "no" of a verb) without a
  traceback.
- Inline code spans that are a whole command (`` `kvpolicy lint --vllm-version 0.34.0` ``) run
  the same way; spans with a placeholder (``FROM``, ``[DIR]``, ``<...>``) are no command, and
  `USAGE_ERROR_SPANS` are the documented usage errors (exit 2).
- Every verb's ``--help`` epilog (and the top-level one): a sample file it shows (a policy test
  case file, a ``--spec`` file) is written out and must pass (``kvpolicy test FILE``,
  ``kvpolicy dry-run --spec FILE``). The ``examples:`` lines of every epilog are run by
  tests/cli/test_cli_help_examples.py (in-process, exit 1 allowed only for lint, diff and compat).
- ``python`` blocks run, in a fresh interpreter per document, in order, sharing names.
- A block preceded by ``<!-- not-run: reason -->`` is skipped, and the reason is
  required; `NOT_RUN` pins how many there are, so the list stays short.

Everything runs in a scratch directory outside the checkout, with the installed package (no
``rules/``, ``docs/`` or ``tests/`` of the checkout: `shipped` names the shipped rules), holding
what the examples name: ``spec.yaml`` (a 4-layer KV spec), ``config.json`` and
``Qwen2.5-0.5B/config.json`` (Qwen2.5-0.5B's Hugging Face config), ``my-rules/`` (an operator's
layer: one prefer rule, its connector file and its tests), ``base/`` and ``site/`` (two small
layers), ``cases/nixl.yaml`` (a case file for ``my-rules/``), ``no-guard/`` (the ``issue-48412``
shipped rules without the per-token-head guard, a replacement of them), ``prefill.json`` and
``decode.json`` (two dry-run documents), ``gemma-2-2b/`` (a model's config), ``rule.yaml``,
``old-rules/`` and ``new-rules/`` (two layers) and docs/examples/ copied as it is (``fleet.yaml``,
``serve.yaml``, ``rollout/``, ``models/``: it names nothing outside itself), under the default
release profile (no
``KVPOLICY_VLLM_VERSION``, no vLLM installed).
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
COMMAND = re.compile(r"((?:[A-Z_]+=\S* )*kvpolicy|python3? -m kvpolicy)\b")


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
        plain = block.lang in ("sh", "bash", "shell") and re.match(COMMAND, line)
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


MY_RULES = """\
version: 1
rules:
  - id: site-prefers-head-major
    description: this site's transfer engine reads one head at a time
    prefer: {head_order: HND}
    weight: 2
"""
MY_CONNECTOR = """\
version: 1
connector: NixlConnector
rules:
  - id: site-nixl-stays-per-layer
    description: this site's NIXL peers register one region per layer
    forbid: {block_outermost: true}
"""
MY_CASES = """\
version: 1
cases:
  - name: the site prefers head-major
    input:
      spec: {num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}
      kv_cache_dtype: auto
      attention_backend: TRITON_ATTN
    expect: {matched: [site-prefers-head-major]}
"""
NIXL_CASES = """\
version: 1
cases:
  - name: NIXL stays per-layer at this site
    input:
      spec: {num_layers: 4, block_size: 16, num_kv_heads: 2, head_size: 64}
      kv_cache_dtype: auto
      attention_backend: TRITON_ATTN
      connector: NixlConnector
    expect: {matched: [site-prefers-head-major, site-nixl-stays-per-layer]}
"""


def _layer(root: Path, text: str, connector: str | None = None) -> None:
    root.mkdir(parents=True)
    (root / "global.yaml").write_text(text)
    if connector:
        (root / "connectors").mkdir()
        (root / "connectors" / "NixlConnector.yaml").write_text(connector)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory outside the checkout holding what the examples name (the module docstring)."""
    box = tmp_path_factory.mktemp("docs")
    assert ROOT not in box.parents
    (box / "spec.yaml").write_text("num_layers: 4\nblock_size: 16\nnum_kv_heads: 2\nhead_size: 64\n")
    config = ROOT / "tests" / "fixtures" / "configs" / "qwen2.5-0.5b.json"
    shutil.copy(config, box / "config.json")
    (box / "Qwen2.5-0.5B").mkdir()
    shutil.copy(config, box / "Qwen2.5-0.5B" / "config.json")
    _layer(box / "my-rules", MY_RULES, MY_CONNECTOR)
    (box / "my-rules" / "tests").mkdir()
    (box / "my-rules" / "tests" / "site.yaml").write_text(MY_CASES)
    (box / "cases").mkdir()
    (box / "cases" / "nixl.yaml").write_text(NIXL_CASES)
    _layer(box / "base", MY_RULES.replace("site-prefers-head-major", "base-prefers-head-major"))
    _layer(box / "site", MY_CONNECTOR.replace("connector: NixlConnector\n", ""))
    shutil.copytree(ROOT / "rules" / "issue-48412", box / "no-guard", ignore=shutil.ignore_patterns("tests"))
    text = (box / "no-guard" / "global.yaml").read_text()
    start = text.index("  - id: per-token-head-forbids-cross-layer")
    end = text.index("  - id: cross-layer-needs-block-stride-indexing")
    (box / "no-guard" / "global.yaml").write_text(text[:start] + text[end:])
    shutil.copytree(ROOT / "tests" / "fixtures" / "model_configs" / "gemma-2-2b-it", box / "gemma-2-2b")
    (box / "rule.yaml").write_text(MY_RULES)
    _layer(box / "old-rules", MY_RULES)
    _layer(box / "new-rules", MY_RULES.replace("HND", "NHD"))
    shutil.copytree(ROOT / "docs" / "examples", box, dirs_exist_ok=True)  # as a user copies it: nothing outside
    for name, version in (("prefill.json", "0.33.0"), ("decode.json", "0.34.0")):
        proc = _run(f"kvpolicy dry-run --vllm-version {version} --format json > {name}", box)
        assert proc.returncode == 0, proc.stderr
    return box


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOLICY_")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["COLUMNS"] = "200"
    return env


def _run(cmd: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``cmd`` under bash; ``kvpolicy`` is this interpreter's, and ``| jq PATH`` is read by Python (jq
    need not be installed): the output must be JSON with that path."""
    jq = None
    if "| jq " in cmd:
        cmd, jq = (part.strip() for part in cmd.split("| jq ", 1))
    cmd = re.sub(r"^((?:[A-Z_]+=\S* )*)kvpolicy\b", lambda m: m[1] + shlex.quote(sys.executable) + " -m kvpolicy",
                 cmd)
    cmd = re.sub(r"^python3? -m kvpolicy\b", shlex.quote(sys.executable) + " -m kvpolicy", cmd)
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=cwd, env=_env(), timeout=300,
                          stdin=subprocess.DEVNULL)
    if jq is not None and proc.returncode in (0, 1):
        data = json.loads(proc.stdout)
        for key in jq.split()[0].strip("'\"").strip(".").split("."):
            assert key in data, f"`jq .{key}`: no such key in the output"
            data = data[key]
    return proc


RUNNABLE = [b for b in ALL if b.not_run is None and (b.lang == "python" or _commands(b))]

# -- every --help epilog ------------------------------------------------------------------------


def _epilogs() -> dict[str, str]:
    from kvpolicy.engine.cli.main import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if a.dest == "verb").choices
    return {"kvpolicy --help": parser.epilog, **{f"kvpolicy {v} --help": p.epilog for v, p in verbs.items()}}


def _sections(epilog: str) -> dict[str, list[str]]:
    """An epilog's sections: a line ending with ``:`` (or ``examples:``) starts one, its indented lines follow."""
    out: dict[str, list[str]] = {}
    title = None
    for line in epilog.splitlines():
        if line and not line.startswith(" "):
            title = line.split(":")[0] if ":" in line else None
            out.setdefault(title or "", [])
        elif title is not None and line.strip():
            out[title].append(line)
    return out


def help_samples() -> list[tuple[str, str, str]]:
    """(where, kind, text) for every sample file an epilog shows: ``cases`` (a policy test file) or ``spec``."""
    import textwrap

    import yaml

    out = []
    for where, epilog in _epilogs().items():
        for title, lines in _sections(epilog or "").items():
            if title == "examples" or not lines:
                continue
            text = textwrap.dedent("\n".join(lines))
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError:
                continue
            if isinstance(data, dict) and "cases" in data:
                out.append((where, "cases", text))
            elif isinstance(data, dict) and "num_layers" in data:
                out.append((where, "spec", text))
    return out


def test_the_harness_sees_the_help_samples() -> None:
    assert {k for _, k, _ in help_samples()} == {"cases", "spec"}


def _check(where: str, cmd: str, proc: subprocess.CompletedProcess[str], must_pass: bool) -> None:
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, f"{where}: `{cmd}`\n{output[-3000:]}"
    allowed = (0,) if must_pass else (0, 1)
    assert proc.returncode in allowed, f"{where}: `{cmd}` exited {proc.returncode}\n{output[-3000:]}"


@pytest.fixture(scope="module")
def ran(sandbox: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every inline example run once, a few at a time (each is a process of its own; lint and diff over a
    release's space take seconds each, so they run side by side)."""
    from concurrent.futures import ThreadPoolExecutor

    cmds = list(dict.fromkeys(c for _, c in INLINE))
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 2)) as pool:
        return dict(zip(cmds, pool.map(lambda c: _run(c, sandbox), cmds)))


@pytest.mark.parametrize(("where", "kind", "text"), help_samples(), ids=lambda x: str(x)[:40])
def test_help_sample_file(where: str, kind: str, text: str, sandbox: Path, tmp_path: Path) -> None:
    path = tmp_path / f"{kind}.yaml"
    path.write_text(text)
    cmd = f"kvpolicy test {path}" if kind == "cases" else f"kvpolicy dry-run --spec {path}"
    _check(where, cmd, _run(cmd, sandbox), must_pass=True)


# -- inline `kvpolicy ...` spans of the docs ------------------------------------------------------

_SPAN = re.compile(r"`((?:[A-Z_]+=\S+ )*kvpolicy [^`]*)`")
_PLACEHOLDER = re.compile(r"\b(FROM|TO|OLD|NEW|DIR|PATH|FILE|N|VERSION)\b|[\[<]|\.\.\.|kvpolicy [\w-]+:")
USAGE_ERROR_SPANS = ("kvpolicy validate nope", "kvpolicy test nope")  # the exit-code table's usage errors
FRAGMENT_SPANS = ("kvpolicy dry-run --kv-transfer-config", "kvpolicy dry-run --fleet",  # flags named in prose
                  "kvpolicy fmt --format json")  # a heading


def inline_commands() -> list[tuple[str, str]]:
    out: dict[str, str] = {}
    for doc in DOCS:
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for m in _SPAN.finditer(line):
                if not _PLACEHOLDER.search(m[1]) and m[1] not in FRAGMENT_SPANS:
                    out.setdefault(m[1], f"{doc.relative_to(ROOT)}:{n}")
    return [(where, cmd) for cmd, where in out.items()]


INLINE = inline_commands()


@pytest.mark.parametrize(("where", "cmd"), INLINE, ids=[f"{w}: {c[:60]}" for w, c in INLINE])
def test_inline_example(where: str, cmd: str, ran: dict[str, subprocess.CompletedProcess[str]]) -> None:
    proc = ran[cmd]
    if cmd in USAGE_ERROR_SPANS:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, f"{where}: `{cmd}`"
        return
    _check(where, cmd, proc, must_pass=False)


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
