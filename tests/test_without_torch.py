"""`pip install kvpolicy` without torch: every decision verb, the library's decision and the vLLM
plugin's decision work; the runtime is one clear error naming the extra (pyproject.toml: `torch`)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A meta-path finder that makes torch (and its submodules) unimportable, as in an install without it.
BLOCKER = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoTorch())
"""

SCRIPT = BLOCKER + """
import contextlib, io, json
from dataclasses import dataclass
from types import SimpleNamespace
from kvpolicy.engine.cli.main import main

codes = {}
for argv in (["validate"], ["test"], ["lint"], ["dry-run"], ["dry-run", "--num-blocks", "8", "--map"],
             ["diff", "RULES", "RULES", "--no-shipped-rules"], ["schema"],
             ["compat", "issue-48412", "vllm-0.34", "--block-size", "16"]):
    argv = [str(RULES) if a == "RULES" else a for a in argv]
    with contextlib.redirect_stdout(io.StringIO()):
        codes[" ".join(argv[:1] + argv[3:])] = main(argv)

from kvpolicy import LayoutEngine
from kvpolicy.engine.integrations.vllm_resolver import resolve

engine = LayoutEngine.default("vllm-0.34")
decision = engine.decide(spec={"num_layers": 4, "num_kv_heads": 2, "head_size": 64},
                         kv_cache_dtype="fp8_per_token_head", connector="OffloadingConnector")

@dataclass(frozen=True)
class FullAttentionSpec:  # vLLM 0.34's spec, as far as the resolver reads it
    block_size: int = 16
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "torch.bfloat16"
    page_size_padded: int | None = None
    dcp_sharded: bool = True
    num_heads: int = 8
    num_states: int = 16
    page_size_bytes: int = 8 * 16 * 2 * 128 * 2

config = SimpleNamespace(
    cache_config=SimpleNamespace(kv_cache_layout=None, cache_dtype="auto", enable_extensible_kv_cache=False),
    kv_transfer_config=SimpleNamespace(kv_connector="OffloadingConnector", kv_connector_extra_config={}),
    attention_config=SimpleNamespace(backend=None, hisparse_config=None),
    parallel_config=SimpleNamespace(pipeline_parallel_size=1), model_config=SimpleNamespace(dtype="torch.bfloat16"))
plugin = resolve(engine, config, [["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC"]], [FullAttentionSpec()])

try:
    engine.build(num_blocks=8, spec={"num_layers": 4, "num_kv_heads": 2, "head_size": 64})
    error = None
except Exception as exc:
    error = {"type": type(exc).__name__, "text": str(exc), "import_error": isinstance(exc, ImportError)}
print(json.dumps({"codes": codes, "layout": str(decision.layout), "plugin": str(plugin.layout), "error": error,
                  "torch_loaded": any(m == "torch" or m.startswith("torch.") for m in sys.modules)}))
"""


def run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", f"RULES = {str(ROOT / 'rules' / 'vllm-0.34')!r}\n" + code],
                          capture_output=True, text=True, cwd=ROOT)


def test_the_blocker_blocks_torch() -> None:
    proc = run_without_torch(BLOCKER + "import torch\n")
    assert proc.returncode == 1 and "No module named 'torch'" in proc.stderr


def test_decisions_work_and_the_runtime_names_the_extra_without_torch() -> None:
    proc = run_without_torch(SCRIPT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["codes"] == {"validate": 0, "test": 0, "lint": 0, "dry-run": 0, "dry-run --map": 0,
                            "diff --no-shipped-rules": 0,
                            "schema": 0, "compat --block-size 16": 0}
    assert out["layout"] == "LBHNC" and out["plugin"] == "LBHNC"
    assert out["error"] == {"type": "MissingDependencyError", "import_error": True,
                            "text": "torch: error[missing-dependency]: kvpolicy's runtime needs torch, which cannot "
                                    "be imported (No module named 'torch')\n  help: pip install 'kvpolicy[torch]'"}
    assert out["torch_loaded"] is False


def test_torch_is_an_extra_and_the_test_extras_include_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.split(">")[0].split("=")[0].strip() == "torch" for d in project["dependencies"])
    assert [d for d in project["optional-dependencies"]["torch"] if d.startswith("torch")] == ["torch>=2.4"]
    assert "kvpolicy[torch]" in project["optional-dependencies"]["test"]
