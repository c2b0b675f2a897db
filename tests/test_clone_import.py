"""`import kvpolicy` from the directory holding a clone named `kvpolicy` (the current directory comes before an
editable install's finder on the path): the clone imports as the package, never as an empty namespace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = """\
from kvpolicy import LayoutEngine, Layout
import kvpolicy, kvpolicy.engine, kvpolicy.policy
decision = LayoutEngine.default().decide(spec={"num_layers": 4, "num_kv_heads": 2, "head_size": 64})
assert isinstance(decision.layout, Layout)
print(kvpolicy.engine.__file__)
"""


@pytest.mark.parametrize("how", ["symlink", "copy"])
def test_a_clone_named_kvpolicy_in_the_current_directory_imports_as_the_package(tmp_path: Path, how: str) -> None:
    clone = tmp_path / "kvpolicy"
    if how == "symlink":
        clone.symlink_to(ROOT, target_is_directory=True)
    else:
        shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".git", "tests", "docs", "bench", "__pycache__",
                                                                  "*.egg-info", ".*"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVPOLICY_RULES")}
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(clone / "engine" / "__init__.py")  # the clone's own code
    done = subprocess.run([sys.executable, "-m", "kvpolicy", "releases"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "vllm-0.34" in done.stdout, done.stderr
