"""`kvpolicy dry-run --fleet FILE` and `kvpolicy diff OLD NEW --fleet FILE`: a fleet of deployments, one report."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cli_capture import cli

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "docs" / "examples" / "fleet.yaml"
ROLLOUT = ROOT / "docs" / "examples" / "rollout"


def test_the_example_fleet_is_decided_in_one_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(FLEET), "--format", "json")
    doc = json.loads(out)
    assert code == 1  # one deployment is refused on purpose
    deps = {d["name"]: d for d in doc["deployments"]}
    assert len(deps) >= 20 and doc["summary"]["deployments"] == len(deps)
    assert {d["profile"] for d in deps.values()} >= {"vllm-0.24", "vllm-0.28", "vllm-0.34"}
    assert doc["summary"]["decided"] == len(deps) - 1 and doc["summary"]["refused"] == 1
    assert deps["chat-qwen-offload-fp8pth"]["layout"] == "LBHNC"
    assert deps["chat-qwen-offload-fp8pth"]["backend"] == "TRITON_ATTN"
    assert deps["llama-8b-offload-0.28"]["placement"] == "cross_layer"  # the gate's uniform cache
    refused = deps["mistral-env-lhbnc-extensible-offload"]
    assert refused["status"] == "refused" and refused["location"].endswith("fleet.yaml:106")
    assert {d["code"] for d in refused["error"]["diagnostics"]} == {"removed-candidates"}
    code, text, _ = cli(capsys, "dry-run", "--fleet", str(FLEET))
    assert f"fleet {FLEET}: {len(deps)} deployments over 9 release profile(s): {len(deps) - 1} decided, 1 refused" \
        in text
    assert "mistral-env-lhbnc-extensible-offload (" in text.split("refused and invalid:")[1]
    assert text.rstrip().splitlines()[-1].startswith(f"{len(deps)} deployments decided in ")


def test_junit_has_a_testcase_per_deployment_and_a_failure_per_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(FLEET), "--format", "junit")
    root = ET.fromstring(out.split("\n", 1)[1])
    suite, exchanges = root.findall("testsuite")  # the deployments, then the exchanges' ordered pairs
    cases = suite.findall("testcase")
    assert code == 1 and int(suite.get("tests")) == len(cases) >= 20
    failed = [c for c in cases if c.find("failure") is not None]
    assert [c.get("name") for c in failed] == ["mistral-env-lhbnc-extensible-offload"]
    assert suite.get("failures") == "1" and exchanges.get("failures") == "2" and root.get("failures") == "3"
    assert failed[0].find("failure").get("type") == "refused" and failed[0].get("line") == "106"


@pytest.mark.parametrize("broken", ["fleet", "rules"])
def test_a_fleet_that_does_not_load_is_a_junit_report_of_the_fleet(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path, broken: str) -> None:
    """The error document is named as the fleet's own report is (`kvpolicy fleet`), not `kvpolicy test`."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("deployments: [1]\n" if broken == "fleet" else FLEET.read_text())
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "global.yaml").write_text("version: 1\nrules: [{id: x}]\n" if broken == "rules" else "version: 1\n")
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(fleet), "--rules", str(rules), "--format", "junit")
    root = ET.fromstring(out.split("\n", 1)[1])
    assert code != 0 and root.get("name") == "kvpolicy fleet" and int(root.get("errors")) >= 1


def test_audit_findings_show_per_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(FLEET), "--rules", str(ROLLOUT), "--format", "json")
    deps = {d["name"]: d for d in json.loads(out)["deployments"]}
    assert code == 1  # the deliberate refusal, not the audit findings
    (finding,) = deps["chat-qwen-offload-fp8pth"]["audit"]
    assert finding["rule"] == "site-per-token-head-stays-nhd" and finding["enforced_layout"] == "LBNHC"
    assert deps["chat-qwen-offload-fp8pth"]["layout"] == "LBHNC"  # audit never changes a layout
    assert deps["chat-qwen-plain"]["audit"] == []


def test_a_fleet_file_with_mistakes_gets_every_one_located(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text("version: 1\ndefaults:\n  vllm_version: 0.34\ndeployments:\n"
                 "  - name: a\n    spec: {num_layers: 2, num_kv_heads: 2, head_size: 64}\n    conector: NixlConnector\n"
                 "  - name: a\n    spec: {num_layers: 2, num_kv_heads: 2, head_size: 64}\n")
    code, _, err = cli(capsys, "dry-run", "--fleet", str(f))
    assert code == 2
    assert f"{f}:7:5: error[unknown-key]" in err and "did you mean `connector`" in err
    assert f"{f}:8:11: error[duplicate-deployment]: deployment `a` is already defined at line 5" in err
    assert err.count("write the vLLM version as a string") == 1  # a bad default: once, where it is written
    assert f"{f}:3:17: error[invalid-value]: write the vLLM version" in err


def test_one_deployment_flags_do_not_mix_with_a_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "dry-run", "--fleet", str(FLEET), "--connector", "NixlConnector")
    assert code == 2 and "--connector describes one deployment" in err
    code, _, err = cli(capsys, "dry-run", "--format", "junit")
    assert code == 2 and "pass --fleet FILE" in err


def test_diff_over_a_fleet_lists_the_deployments_whose_decision_changes(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "global.yaml").write_text("version: 1\nrules: []\n")
    (new / "global.yaml").write_text(ROLLOUT.joinpath("global.yaml").read_text().replace(
        "    enforcement: audit\n", ""))
    code, out, _ = cli(capsys, "diff", str(old), str(new), "--fleet", str(FLEET))
    assert code == 1
    assert out.startswith(f"diff over fleet {FLEET}: ")
    assert "  chat-qwen-offload-fp8pth (" in out and "LBHNC -> LBNHC" in out
    assert "because of site-per-token-head-stays-nhd (forbid, global) at " in out
    assert "chat-qwen-plain" not in out
    code, out, _ = cli(capsys, "diff", str(old), str(old), "--fleet", str(FLEET), "--format", "json")
    assert code == 0 and json.loads(out)["changes"] == []


def test_a_decision_whose_views_overlap_is_unsafe(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                  no_pth: Path) -> None:
    """dry-run's geometry check, per deployment: vLLM #48412's combination without the guard."""
    f = tmp_path / "fleet.yaml"
    f.write_text(f"""version: 1
deployments:
  - name: seed-bug
    vllm_version: issue-48412
    model: {ROOT}/tests/fixtures/configs/qwen2.5-0.5b.json
    kv_cache_dtype: fp8_per_token_head
    attention_backend: TRITON_ATTN
    connector: NixlConnector
    connector_config: {{enable_cross_layers_blocks: "true"}}
  - name: plain
    vllm_version: issue-48412
    spec: {{num_layers: 4, num_kv_heads: 2, head_size: 64}}
""")
    args = ("dry-run", "--fleet", str(f), "--rules", str(no_pth), "--no-shipped-rules", "--vllm-version", "issue-48412")
    code, out, _ = cli(capsys, *args, "--format", "json")
    deps = {d["name"]: d for d in json.loads(out)["deployments"]}
    assert code == 1 and deps["seed-bug"]["status"] == "unsafe" and deps["plain"]["status"] == "decided"
    assert deps["seed-bug"]["geometry"]["kind"] == "GeometryError"
    assert {d["code"] for d in deps["seed-bug"]["geometry"]["diagnostics"]} == {"overlapping-views"}
    code, out, _ = cli(capsys, *args)
    assert "1 decided, 1 unsafe, 0 refused" in out and "UNSAFE: views write the same bytes" in out


def _fleet(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "fleet.yaml"
    f.write_text(text)
    return f


SPEC = "{num_layers: 4, num_kv_heads: 2, head_size: 64}"


def test_the_default_release_is_said_only_when_a_deployment_falls_back_to_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpolicy.policy import releases

    monkeypatch.delenv("KVPOLICY_VLLM_VERSION", raising=False)
    monkeypatch.setattr(releases, "_installed", lambda _path: None)  # no vLLM here
    named = _fleet(tmp_path, f'version: 1\ndefaults: {{vllm_version: "0.34.0"}}\n'
                             f"deployments:\n  - name: a\n    spec: {SPEC}\n")
    for verb in (["dry-run", "--fleet", str(named)], ["diff", "shipped", "shipped", "--fleet", str(named)],
                 ["lint", "--fleet", str(named)]):
        _code, _out, err = cli(capsys, *verb)
        assert "no vLLM is installed" not in err, verb
    falls = _fleet(tmp_path, f'version: 1\ndeployments:\n  - name: a\n    vllm_version: "0.34.0"\n    spec: {SPEC}\n'
                             f"  - name: b\n    spec: {SPEC}\n")
    code, _out, err = cli(capsys, "dry-run", "--fleet", str(falls))
    assert code == 0 and err.count("note: no vLLM is installed here") == 1


INVALID = f"""version: 1
defaults:
  vllm_version: "0.34.0"
deployments:
  - name: typo
    spec: {SPEC}
    connector: NixlConector
  - name: fine
    spec: {SPEC}
  - name: own
    spec: {SPEC}
    connector: MyConnector
    connector_module_path: site.connectors
"""


def test_a_connector_refusal_is_located_at_its_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = _fleet(tmp_path, INVALID)
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(f), "--format", "json")
    typo = next(d for d in json.loads(out)["deployments"] if d["name"] == "typo")
    where, = [(d["line"], d["col"]) for d in typo["error"]["diagnostics"]]
    assert code == 1 and where == (7, 16)  # `connector: NixlConector`, not the deployment's line 5


def test_diff_shows_an_invalid_deployment_and_model_notes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = _fleet(tmp_path, INVALID)
    code, out, _ = cli(capsys, "diff", "shipped", "shipped", "--fleet", str(f))
    assert code == 1  # as dry-run --fleet: an invalid deployment is no pass
    assert "0 decision(s) change, 1 invalid" in out
    assert f"  typo ({f}:5):" in out and f"{f}:7:16: error[unknown-connector]" in out
    code, out, _ = cli(capsys, "diff", "shipped", "shipped", "--fleet", str(f), "--format", "json")
    data = json.loads(out)
    assert code == 1 and [(i["name"], i["location"]) for i in data["invalid"]] == [("typo", f"{f}:7:16")]
    code, out, _ = cli(capsys, "diff", "shipped", "shipped", "--fleet", str(FLEET))
    assert code == 0
    assert "gpt-oss-20b-offload: models/gpt-oss-20b/config.json: warning[assumed-dtype]" in out.replace(
        str(FLEET.parent) + "/", "")


def test_a_declared_connector_is_warned_about_once(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = _fleet(tmp_path, INVALID)
    _code, out, _ = cli(capsys, "dry-run", "--fleet", str(f), "--format", "json")
    own = next(d for d in json.loads(out)["deployments"] if d["name"] == "own")
    assert own["warnings"] == ["warning: connector `MyConnector` (from kv_connector_module_path): no connector file "
                               "of the rules names it, so only the global rules apply to it"]
    code, out, err = cli(capsys, "dry-run", "--vllm-version", "0.34.0", "--spec", str(_spec(tmp_path)),
                         "--connector", "MyConnector", "--connector-module-path", "site.connectors", "--format", "json")
    assert code == 0 and json.loads(out)["warnings"] == own["warnings"]
    assert "did you mean `MultiConnector`" not in out + err


def _spec(tmp_path: Path) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text("num_layers: 4\nnum_kv_heads: 2\nhead_size: 64\n")
    return spec


def test_a_members_and_a_transfer_configs_connector_are_located_at_their_names(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = _fleet(tmp_path, f"""version: 1
defaults: {{vllm_version: "0.34.0"}}
deployments:
  - name: member
    spec: {SPEC}
    connector: MultiConnector
    connector_config:
      connectors:
        - {{kv_connector: NixlConnector}}
        - {{kv_connector: OffloadConnector}}
  - name: ktc
    spec: {SPEC}
    kv_transfer_config: {{kv_connector: LMCacheConector, kv_role: kv_both}}
""")
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(f), "--format", "json")
    where = {d["name"]: [(x["line"], x["col"]) for x in d["error"]["diagnostics"]]
             for d in json.loads(out)["deployments"]}
    assert code == 1 and where == {"member": [(10, 26)], "ktc": [(13, 40)]}


def test_rules_that_do_not_load_are_one_error_not_every_deployments(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    layer = tmp_path / "dup"
    layer.mkdir()
    (layer / "global.yaml").write_text("version: 1\nrules:\n  - id: env-layout-lbnhc\n    description: x\n"
                                       "    forbid: {placement: cross_layer}\n")
    for verb, expected in ((["dry-run", "--fleet", str(FLEET), "--rules", str(layer)], 1),
                           (["lint", str(layer), "--fleet", str(FLEET)], 1),
                           (["diff", "shipped", str(layer), "--fleet", str(FLEET)], 2)):
        code, out, err = cli(capsys, *verb)
        assert code == expected and err.count("error[duplicate-rule-id]") == 1, verb
        assert "invalid-deployment" not in out + err


def test_a_deployments_dtype_and_sliding_window_are_applied(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    """`dtype:` and `disable_sliding_window:` in a fleet (the keys of a case input) decide as the flags do: Gemma-2
    in float32 runs TRITON_ATTN (FLASH_ATTN takes fp16/bf16 only); they were accepted and silently dropped."""
    gemma2 = ROOT / "tests" / "fixtures" / "model_configs" / "gemma-2-2b-it"
    (tmp_path / "fleet.yaml").write_text(
        "version: 1\ndefaults: {vllm_version: \"0.34.0\"}\ndeployments:\n"
        f"  - {{name: served-as-is, model: {gemma2}}}\n"
        f"  - {{name: fp32, model: {gemma2}, dtype: float32}}\n"
        f"  - {{name: no-windows, model: {gemma2}, disable_sliding_window: true}}\n")
    code, out, err = cli(capsys, "dry-run", "--fleet", str(tmp_path / "fleet.yaml"), "--format", "json")
    assert code == 0, err
    rows = {d["name"]: d for d in json.loads(out)["deployments"]}

    def single(*flags: str) -> dict:
        _, text, _ = cli(capsys, "dry-run", "--model", str(gemma2), "--vllm-version", "0.34.0", *flags,
                         "--format", "json")
        return json.loads(text)["fingerprint"]

    fp32, no_windows, plain = single("--dtype", "float32"), single("--disable-sliding-window"), single()
    assert (rows["fp32"]["backend"], rows["fp32"]["fingerprint"]) == ("TRITON_ATTN", fp32["digest"])
    assert (rows["served-as-is"]["backend"], rows["served-as-is"]["fingerprint"]) == ("FLASH_ATTN", plain["digest"])
    assert rows["no-windows"]["fingerprint"] == no_windows["digest"] != plain["digest"]


def test_diff_over_a_fleet_says_which_preference_drives_a_change(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "global.yaml").write_text("version: 1\nrules:\n  - id: site-prefer-hnd\n    description: HND here\n"
                                      "    prefer: {head_order: HND}\n")
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"version: 1\ndeployments:\n  - name: plain\n    model: {ROOT}/docs/examples/models/qwen2.5-0.5b\n"
                     "    vllm_version: \"0.34.0\"\n")
    code, out, _ = cli(capsys, "diff", "shipped", str(site), "--fleet", str(fleet), "--format", "json")
    (change,) = json.loads(out)["changes"]
    assert code == 1 and (change["old"], change["new"]) == ("LBNHC", "LBHNC")
    (why,) = change["why"]  # as the non-fleet diff says "because site-prefer-hnd (site/global.yaml:3)"
    assert why.startswith("site-prefer-hnd (prefer +") and why.endswith(f", global) at {site}/global.yaml:3")
    code, out, _ = cli(capsys, "diff", "shipped", str(site), "--fleet", str(fleet))
    assert "because of site-prefer-hnd (prefer +" in out and f"at {site}/global.yaml:3" in out


@pytest.mark.parametrize("verb", [["dry-run"], ["diff", "shipped", "shipped"], ["lint"]])
def test_a_fleet_run_says_it_does_not_read_vllm_variables(verb: list[str], monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"version: 1\ndeployments:\n  - name: plain\n    model: {ROOT}/docs/examples/models/qwen2.5-0.5b\n"
                     "    vllm_version: \"0.34.0\"\n")
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLNHC")
    _, _, err = cli(capsys, *verb, "--fleet", str(fleet))
    assert "note: VLLM_KV_CACHE_LAYOUT=BLNHC is not read for a fleet's deployments" in err
    assert "`vllm_kv_cache_layout: BLNHC`" in err
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")
    _, _, err = cli(capsys, *verb, "--fleet", str(fleet))
    assert "VLLM_KV_CACHE_LAYOUT" not in err


def test_a_cache_the_cpu_kernel_refuses_is_refused_in_a_fleet_as_alone(capsys: pytest.CaptureFixture[str],
                                                                       tmp_path: Path) -> None:
    """vLLM 0.28's CPU attention writes fp8 only with its 32-token kernels: a fleet says what dry-run says of the
    same deployment (the kernel order is part of the decision, not only of its rendering)."""
    model = ROOT / "docs" / "examples" / "models" / "qwen2.5-0.5b"
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"version: 1\ndefaults: {{model: {model}, device: cpu, vllm_version: '0.28.0', "
                     "cpu: x86+avx512}\n"
                     "deployments:\n  - {name: b32, kv_cache_dtype: fp8, block_size: 32}\n"
                     "  - {name: b16, kv_cache_dtype: fp8, block_size: 16}\n")
    code, out, _ = cli(capsys, "dry-run", "--fleet", str(fleet), "--format", "json")
    status = {d["name"]: d["status"] for d in json.loads(out)["deployments"]}
    assert code == 1 and status == {"b32": "decided", "b16": "invalid"}
    assert "cpu-kernel-refuses" in out
    code, _, err = cli(capsys, "dry-run", "--model", str(model), "--device", "cpu", "--vllm-version", "0.28.0",
                       "--cpu", "x86+avx512", "--kv-cache-dtype", "fp8", "--block-size", "16")
    assert code == 2 and "error[cpu-kernel-refuses]" in err


MISTAKES = f"""version: 1
defaults:
  vllm_version: "0.99"
deployments:
  - name: a
    spec: {SPEC}
    kv_cache_dtype: fp9
  - name: b
    spec: {SPEC}
    conector: NixlConnector
    connector: NixlConnector
  - name: c
    spec: {SPEC}
    attention_backend: FLASH_ATN
exchanges:
  - name: x
    deployments: [a, b, zz]
  - name: y
    deployments: [a, b]
"""


@pytest.mark.parametrize("verb", [["dry-run"], ["lint"], ["dry-run", "--format", "json"]])
def test_every_mistake_of_a_fleet_file_is_reported_in_one_run(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                              verb: list[str]) -> None:
    """The file's keys, its default release (once, where it is written), its exchanges (also between deployments
    with a wrong key) and its deployments' inputs: every mistake at its line:col, exit 2, in one run."""
    path = _fleet(tmp_path, MISTAKES)
    code, out, err = cli(capsys, *verb, "--fleet", str(path))
    said = out + err
    assert code == 2, said
    found = [(":3:17:", "unknown-vllm-version"), (":7:21:", "unknown-kv-cache-dtype"), (":10:5:", "unknown-key"),
             (":14:24:", "unknown-backend"), (":17:25:", "unknown-deployment"), (":19:18:", "exchange-connector")]
    if "json" in verb:
        diags = json.loads(out)["error"]["diagnostics"]
        assert [(f":{d['line']}:{d['col']}:", d["code"]) for d in diags] == found
    else:
        assert all(f"{path}{where} error[{code}]" in said for where, code in found), said
        assert said.count("`0.99`") == 1  # once, where it is written


@pytest.mark.parametrize("verb", [["dry-run"], ["lint"], ["diff", str(ROLLOUT), str(ROLLOUT)]])
def test_a_bad_default_release_is_one_error_where_it_is_written(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                verb: list[str]) -> None:
    path = _fleet(tmp_path, 'version: 2\ndefaults:\n  vllm_version: "0.99"\ndeployments:\n'
                            + "".join(f"  - name: d{i}\n    spec: {SPEC}\n" for i in range(4)))
    code, out, err = cli(capsys, *verb, "--fleet", str(path))
    assert code == 2, out + err
    assert f"{path}:3:17: error[unknown-vllm-version]: no profile for vLLM version `0.99`" in err
    assert f"{path}:1:10: error[" in err  # the header's own mistake, in the same run
    assert (out + err).count("`0.99`") == 1
