"""`kvpolicy compat`: whether blocks of one deployment restore in another, as is, transcoded, or not at all."""

from __future__ import annotations

import json
from pathlib import Path

from cli_capture import cli

from kvpolicy.policy.releases import profile_names


def test_two_releases_whose_rows_match_exchange_as_is(capsys) -> None:
    code, out, err = cli(capsys, "compat", "vllm-0.28", "0.34.0", "--block-size", "16")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("FROM vllm-0.28: LBHNC on TRITON_ATTN, fp8_per_token_head, 24 layers, block 16")
    assert lines[2].startswith("compared: raw blocks, as kvpolicy's own restore reads them")
    assert lines[3] == "exchange: as is: every byte of a block means the same on both sides"
    assert "  descriptors per block: 24 at FROM, 24 at TO" in lines
    assert "    num_buffers: source 24, target 1" in lines  # per-layer buffers vs one: no byte moves


def test_the_reproduction_pair_transcodes_and_says_what_it_costs(capsys) -> None:
    code, out, _ = cli(capsys, "compat", "issue-48412", "vllm-0.34", "--block-size", "16", "--kv-cache-dtype", "auto",
                       "--format", "json")
    report = json.loads(out)
    assert code == 0 and report["exchange"] == "transcode"
    assert (report["from"]["layout"], report["to"]["layout"]) == ("BLNHC", "LBHNC")
    assert report["cost"] == {"bytes_per_block": {"from": 24 * 8192, "to": 24 * 8192},
                              "descriptors_per_block": {"from": 1, "to": 24}}


def test_cells_that_differ_are_not_exchanged_and_each_field_is_named(capsys, tmp_path: Path) -> None:
    code, out, _ = cli(capsys, "dry-run", "--vllm-version", "0.28.0", "--block-size", "16", "--format", "json")
    assert code == 0
    (tmp_path / "prefill.json").write_text(out)
    code, out, _ = cli(capsys, "compat", str(tmp_path / "prefill.json"), "vllm-0.34", "--block-size", "16",
                       "--kv-cache-dtype", "int8_per_token_head")
    assert code == 1
    assert "exchange: not at all" in out
    assert "    quant_mode: source fp8_per_token_head, target int8_per_token_head" in out.splitlines()
    code, out, _ = cli(capsys, "compat", "vllm-0.28", "vllm-0.34")  # each release's default block size
    assert code == 1 and "    block_size: source 16, target 64" in out.splitlines()


def test_the_table_answers_for_every_pair_of_profiles(capsys) -> None:
    code, out, _ = cli(capsys, "compat", "--table", "--block-size", "16", "--format", "json")
    table = json.loads(out)
    names = list(profile_names())
    assert code == 0 and table["profiles"] == names
    kinds = table["exchanges"]
    assert all(kinds[i][i] == "as_is" for i in range(len(names)))
    assert {k for row in kinds for k in row} == {"as_is", "transcode"}  # one kv_cache_dtype: never refused
    old, new = names.index("vllm-0.26"), names.index("vllm-0.34")
    assert table["deployments"][old]["layout"] == "BHLNC" and kinds[old][new] == "transcode"
    code, out, _ = cli(capsys, "compat", "--table", "--block-size", "16")
    assert out.splitlines()[1].split()[:3] == ["vllm-0.34", "LBHNC", "b16"]


def test_mistakes_are_usage_errors_naming_the_argument(capsys, tmp_path: Path) -> None:
    code, _, err = cli(capsys, "compat", "vllm-0.28")
    assert code == 2 and err.startswith("FROM: error[usage]: give the two deployments")
    code, _, err = cli(capsys, "compat", "vllm-0.28", "nope")
    assert code == 2 and err.startswith("TO: error[usage]: `nope` is neither a file nor a vLLM release")
    (tmp_path / "x.json").write_text('{"layout": "LBHNC"}')
    code, _, err = cli(capsys, "compat", str(tmp_path / "x.json"), "vllm-0.34")
    assert code == 2 and "holds no layout fingerprint" in err
    code, _, err = cli(capsys, "compat", "--table", "vllm-0.34")
    assert code == 2 and err.startswith("--table: error[usage]")


def _dry_run(capsys, tmp_path: Path, *flags: str) -> Path:
    _, out, _ = cli(capsys, "dry-run", "--format", "json", *flags)
    path = tmp_path / f"dry{len(list(tmp_path.iterdir()))}.json"
    path.write_text(out)
    return path


def test_files_that_are_not_a_decided_dry_run_are_named_for_what_they_are(capsys, tmp_path: Path) -> None:
    """Hostile review: deep or huge-integer JSON gave a traceback; a lint document or a failed dry-run a dump
    of missing fields with a library's help; flags beside two files were silently ignored."""
    good = _dry_run(capsys, tmp_path)
    deep, huge = tmp_path / "deep.json", tmp_path / "huge.json"
    deep.write_text('{"a":' * 5000 + "1" + "}" * 5000)
    huge.write_text('{"num_layers": ' + "9" * 5000 + "}")
    lint = tmp_path / "lint.json"  # another verb's document: it has a format_version too
    lint.write_text(json.dumps({"format_version": 1, "ok": True, "profile": "vllm-0.34", "findings": []}))
    failed = _dry_run(capsys, tmp_path, "--attention-backend", "FLASHMLA")
    for path, said in ((deep, "nests deeper"), (huge, "not a JSON fingerprint"), (lint, "holds no layout fingerprint"),
                       (failed, "command that failed: --attention-backend: backend `FLASHMLA` does not fit")):
        code, out, err = cli(capsys, "compat", str(path), str(good))
        assert code == 2 and said in err and "Traceback" not in err, (path.name, err)
    code, _, err = cli(capsys, "compat", str(good), str(good), "--block-size", "32")
    assert code == 2 and err.startswith("--block-size: error[usage]: --block-size describes the deployment")
    code, out, _ = cli(capsys, "compat", str(good), str(good))
    assert code == 0 and "exchange: as is" in out
