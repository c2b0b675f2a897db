"""`kvpolicy dry-run ... --record-test FILE`: today's decision kept as a policy test case that `kvpolicy test` runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from cli_capture import cli

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
SPEC = "num_layers: 4\nnum_kv_heads: 2\nhead_size: 64\n"
V = ("--vllm-version", "0.34.0")


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.yaml").write_text(SPEC)
    shutil.copy(CONFIGS / "llama-3.1-8b.json", tmp_path / "llama.json")
    return tmp_path


def test_a_recorded_decision_passes_today_and_fails_when_a_rule_changes_it(
        capsys: pytest.CaptureFixture[str], here: Path) -> None:
    code, _, err = cli(capsys, "dry-run", *V, "--spec", "spec.yaml", "--vllm-kv-cache-layout", "BLHNC",
                       "--enable-extensible-kv-cache", "--connector", "OffloadingConnector",
                       "--record-test", "tests/recorded.yaml")
    assert code == 0 and "recorded: case `spec, OffloadingConnector, vllm-0.34 takes BLHNC` in tests/recorded.yaml" \
        in err
    (case,) = yaml.safe_load((here / "tests" / "recorded.yaml").read_text())["cases"]
    assert case["input"] == {"spec": {"num_layers": 4, "num_kv_heads": 2, "head_size": 64},
                             "connector": "OffloadingConnector", "vllm_version": "vllm-0.34",
                             "vllm_kv_cache_layout": "BLHNC", "enable_extensible_kv_cache": True}
    assert case["expect"]["layout"] == "BLHNC"
    assert case["expect"]["removed"]["LBHNC"] == ["env-layout-blhnc"]
    assert cli(capsys, "test", "tests/recorded.yaml", *V)[0] == 0
    site = here / "site"
    site.mkdir()
    (site / "global.yaml").write_text("version: 1\nrules:\n  - id: no-outermost\n    description: x\n"
                                      "    forbid: {block_outermost: true}\n")
    code, out, _ = cli(capsys, "test", "tests/recorded.yaml", "--rules", str(site), *V)
    assert code == 1 and "FAIL tests/recorded.yaml:3:" in out


def test_a_model_is_recorded_relative_to_the_case_file_and_cases_append(
        capsys: pytest.CaptureFixture[str], here: Path) -> None:
    (here / "tests").mkdir()
    (here / "tests" / "fleet.yaml").write_text("version: 1\n# our deployments\ncases:\n  - name: first\n"
                                               "    input: {spec: {num_layers: 2, num_kv_heads: 2, head_size: 64}}\n"
                                               "    expect: {layout: LBNHC}\n")
    code, _, _ = cli(capsys, "dry-run", *V, "--model", "llama.json", "--kv-cache-dtype", "fp8",
                     "--connector", "NixlConnector", "--record-test", "tests/fleet.yaml", "--record-name", "llama nixl")
    text = (here / "tests" / "fleet.yaml").read_text()
    assert code == 0 and "# our deployments" in text  # appended: what was there stays as written
    cases = yaml.safe_load(text)["cases"]
    assert [c["name"] for c in cases] == ["first", "llama nixl"]
    assert cases[1]["input"]["model"] == "../llama.json"
    assert cli(capsys, "test", "tests/fleet.yaml", *V)[0] == 0
    code, _, err = cli(capsys, "dry-run", *V, "--model", "llama.json", "--record-test", "tests/fleet.yaml",
                       "--record-name", "llama nixl")
    assert code == 2 and "already has a case named `llama nixl`" in err
    assert (here / "tests" / "fleet.yaml").read_text() == text


def test_a_refused_deployment_is_recorded_as_a_no_layout_case(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    code, _, _ = cli(capsys, "dry-run", *V, "--spec", "spec.yaml", "--vllm-kv-cache-layout", "LHBNC",
                     "--enable-extensible-kv-cache", "--connector", "OffloadingConnector", "--record-test", "r.yaml")
    assert code == 1
    (case,) = yaml.safe_load((here / "r.yaml").read_text())["cases"]
    assert case["expect"] == {"error": "no-layout"}
    assert cli(capsys, "test", "r.yaml", *V)[0] == 0


def test_audit_findings_are_recorded_and_checked(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    rollout = str(Path(__file__).resolve().parents[2] / "docs" / "examples" / "rollout")
    code, _, _ = cli(capsys, "dry-run", *V, "--rules", rollout, "--record-test", "a.yaml")
    (case,) = yaml.safe_load((here / "a.yaml").read_text())["cases"]
    assert code == 0 and case["expect"] == {"layout": "LBHNC", "audit": ["site-per-token-head-stays-nhd"]}
    assert cli(capsys, "test", "a.yaml", "--rules", rollout, *V)[0] == 0
    code, _, err = cli(capsys, "test", "a.yaml", *V)  # without the layer: the rule id is unknown
    assert code == 1 and "a.yaml:12:15: error[unknown-rule]: no rule `site-per-token-head-stays-nhd`" in err
    (here / "b.yaml").write_text("version: 1\ncases:\n  - name: no findings expected\n"
                                 "    input: {spec: {num_layers: 24, num_kv_heads: 2, head_size: 64},"
                                 " kv_cache_dtype: fp8_per_token_head, connector: OffloadingConnector}\n"
                                 "    expect: {layout: LBHNC, audit: []}\n")
    code, out, _ = cli(capsys, "test", "b.yaml", "--rules", rollout, *V)
    assert code == 1
    assert "  expected audit findings: nothing\n  actual audit findings:   `site-per-token-head-stays-nhd`" in out


def test_a_serve_line_and_the_vllm_environment_are_recorded(capsys: pytest.CaptureFixture[str], here: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    code, _, _ = cli(capsys, "dry-run", *V, "--record-test", "s.yaml", "--", "vllm", "serve", "./llama.json",
                     "--kv-cache-dtype", "fp8", "--dtype", "float16")
    (case,) = yaml.safe_load((here / "s.yaml").read_text())["cases"]
    assert code == 0 and case["input"] == {"model": "llama.json", "dtype": "float16", "kv_cache_dtype": "fp8",
                                           "vllm_version": "vllm-0.34", "vllm_kv_cache_layout": "HND"}
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")
    assert cli(capsys, "test", "s.yaml", *V)[0] == 0  # the case carries the environment: it does not read it


def test_a_fifo_or_device_to_record_into_is_refused_unread(capsys: pytest.CaptureFixture[str], here: Path) -> None:
    # `--record-test /dev/full` read the existing "file" whole first (endless zeros: a process that never ends),
    # and a FIFO blocked; a case file is read as every case file is (a regular file, bounded), else refused
    import os
    import threading

    fifo = here / "cases.yaml"
    os.mkfifo(fifo)
    opened = threading.Event()

    def writer() -> None:  # blocks in open() until someone reads the FIFO
        try:
            with open(fifo, "w") as f:
                opened.set()
                f.write("version: 1\ncases: []\n")
        except BrokenPipeError:  # the reader that released it is gone
            pass

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        code, _, err = cli(capsys, "dry-run", *V, "--spec", "spec.yaml", "--record-test", "cases.yaml")
        assert code == 2 and "--record-test: error[usage]: cannot read `cases.yaml`: not a regular file" in err
        assert not opened.is_set()  # never opened, so never read
    finally:
        if not opened.is_set():
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # let the writer go
        t.join(5)


@pytest.mark.parametrize("flag", ["--record-test", "--svg"])
@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_path_to_write_is_a_usage_error(capsys: pytest.CaptureFixture[str], here: Path, flag: str,
                                                 path: str) -> None:
    # `--svg ""` (an unset shell variable) read as no flag: exit 0, nothing written, nothing said
    code, _, err = cli(capsys, "dry-run", *V, "--spec", "spec.yaml", flag, path)
    assert code == 2 and f"{flag}: error[usage]: the path is empty" in err


@pytest.mark.parametrize("flag", ["--record-test", "--svg"])
@pytest.mark.parametrize("path", ["spec.yaml/new.yaml", "/dev/full"])
def test_a_file_that_cannot_be_written_is_an_error_with_a_help_line(capsys: pytest.CaptureFixture[str], here: Path,
                                                                     flag: str, path: str) -> None:
    """Every error says what to do: a folder that is a file, a full disk; the files there are as they were."""
    code, _, err = cli(capsys, "dry-run", *V, "--spec", "spec.yaml", flag, path)
    assert code in (1, 2) and f"{flag}: error[" in err, err
    assert "\n  help: " in err.split(f"{flag}: error[", 1)[1], err
    assert (here / "spec.yaml").read_text() == SPEC


def test_a_full_disk_is_write_failed_exit_1_and_the_case_file_is_whole(capsys: pytest.CaptureFixture[str],
                                                                        here: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/cli.md, Exit codes: output that cannot be written (a full disk) is `error[write-failed]`, exit 1, as
    `--svg` has it; the path was right, so it is no usage error. The case file is as it was."""
    import errno

    import kvpolicy.engine.cli.record_case as record_case

    code, _, _ = cli(capsys, "dry-run", *V, "--spec", "spec.yaml", "--record-test", "cases.yaml")
    assert code == 0
    before = (here / "cases.yaml").read_text()

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_case, "write_atomically", full)
    code, _, err = cli(capsys, "dry-run", *V, "--spec", "spec.yaml", "--record-test", "cases.yaml",
                       "--record-name", "another")
    assert code == 1 and "--record-test: error[write-failed]: cannot write `cases.yaml`" in err
    assert "\n  help: " in err and (here / "cases.yaml").read_text() == before
