# ruff: noqa  (hostile-pass scripts, not product code)
"""Class 4: the plugin's inputs (KVPOLICY_* variables, vLLM's objects, connector extra configs of hostile
shapes). Only the documented exceptions may escape: PluginError / RuleLoadError from register(),
StartupError (and NoLayoutError from the gate) from the hooks. Run: python hostile/class4_plugin.py"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import types
from collections import OrderedDict, UserDict, defaultdict
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests" / "engine" / "integrations"))
from _common import report, summary

CHILD = r'''
import json, logging, os, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from fake_vllm import fake_vllm
from kvpolicy.engine.integrations import vllm_plugin
from kvpolicy.policy.errors import PolicyError
logging.disable(logging.CRITICAL)
env = json.loads(sys.argv[3])
for k in ("KVPOLICY_VLLM_VERSION", "KVPOLICY_VLLM_PROFILE", "KVPOLICY_RULES", "KVPOLICY_EXPLAIN", "KVPOLICY_SHIPPED_RULES"):
    os.environ.pop(k, None)
for k, v in env.items():
    os.environ[k] = os.fsdecode(v.encode("latin-1")) if k == "KVPOLICY_RULES" and v.startswith("\x00raw:") is False and False else v
if "KVPOLICY_RULES_RAW" in env:
    os.environb[b"KVPOLICY_RULES"] = env["KVPOLICY_RULES_RAW"].encode("latin-1")
with fake_vllm(Path(sys.argv[2]), "0.34.0" if sys.argv[4] == "0.34" else "0.28.0", sys.argv[4]):
    try:
        vllm_plugin.register()
        out = {"ok": True, "status": vllm_plugin.status()}
    except PolicyError as e:
        out = {"ok": False, "type": type(e).__name__, "documented": type(e).__name__ in ("PluginError", "RuleLoadError"),
               "text": e.render()[:300]}
    except BaseException as e:
        out = {"ok": False, "type": type(e).__name__, "documented": False, "text": str(e)[:300]}
print("RESULT " + json.dumps(out))
'''


def register_in_child(env: dict, flavor: str, timeout: float = 30) -> dict:
    import time
    start = time.monotonic()
    out = _register_in_child(env, flavor, timeout)
    out["seconds"] = time.monotonic() - start
    return out


def _register_in_child(env: dict, flavor: str, timeout: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="host23-c4-"))
    (tmp / "child.py").write_text(CHILD)
    try:
        p = subprocess.run([sys.executable, str(tmp / "child.py"), str(ROOT / "tests/engine/integrations"),
                            str(tmp / "site"), json.dumps(env), flavor], capture_output=True, text=True,
                           timeout=timeout, cwd=tmp)
    except subprocess.TimeoutExpired:
        return {"ok": False, "type": "HANG", "documented": False, "text": f"register() did not return in {timeout} s"}
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        return {"ok": False, "type": "CRASH", "documented": False, "text": (p.stderr or p.stdout)[-300:]}
    return json.loads(line[0][7:])


def env_cases(base: Path) -> dict:
    base.mkdir(parents=True, exist_ok=True)
    good = base / "good"
    (good / "connectors").mkdir(parents=True)
    (good / "global.yaml").write_text("version: 1\nrules: []\n")
    f = base / "afile.yaml"
    f.write_text("version: 1\nrules: []\n")
    fifo = base / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "global.yaml")
    zero = base / "zero"
    zero.mkdir()
    os.symlink("/dev/zero", zero / "global.yaml")
    urandom = base / "urandom"
    urandom.mkdir()
    (urandom / "connectors").mkdir()
    os.symlink("/dev/urandom", urandom / "connectors" / "X.yaml")
    loop = base / "loop"
    (loop).mkdir()
    os.symlink(loop, loop / "connectors")
    gdir = base / "gdir"
    (gdir / "global.yaml").mkdir(parents=True)
    cfile = base / "cfile"
    cfile.mkdir()
    (cfile / "connectors").write_text("x")
    dangling = base / "dangling"
    dangling.mkdir()
    os.symlink(base / "nope", dangling / "global.yaml")
    nested = base / "nested"
    (nested / "connectors" / "sub").mkdir(parents=True)
    (nested / "connectors" / "sub" / "X.yaml").write_text("version: 1\nconnector: X\nrules: []\n")
    bigf = base / "big"
    bigf.mkdir()
    (bigf / "global.yaml").write_text("version: 1\nrules: []\n" + "#" * 2_000_000 + "\n")
    c = {
        "nonexistent": {"KVPOLICY_RULES": str(base / "nope")},
        "a-file": {"KVPOLICY_RULES": str(f)},
        "fifo-global": {"KVPOLICY_RULES": str(fifo)},
        "dev-zero-global": {"KVPOLICY_RULES": str(zero)},
        "dev-urandom-connector": {"KVPOLICY_RULES": str(urandom)},
        "symlink-loop": {"KVPOLICY_RULES": str(loop)},
        "global-is-dir": {"KVPOLICY_RULES": str(gdir)},
        "connectors-is-file": {"KVPOLICY_RULES": str(cfile)},
        "dangling-global": {"KVPOLICY_RULES": str(dangling)},
        "nested-connector-dir": {"KVPOLICY_RULES": str(nested)},
        "2MB-comment": {"KVPOLICY_RULES": str(bigf)},
        "3000-layers-same-dir": {"KVPOLICY_RULES": ":".join([str(good)] * 3000)},
        "whitespace-only": {"KVPOLICY_RULES": "   "},
        "SHIPPED-upper": {"KVPOLICY_RULES": " SHIPPED "},
        "shipped-and-dir": {"KVPOLICY_RULES": f"shipped:{good}"},
        "component-256": {"KVPOLICY_RULES": "/tmp/" + "z" * 256},
        "non-utf8-path": {"KVPOLICY_RULES_RAW": str(base).encode().decode("latin-1") + "/\xff\xfe"},
        "newline-path": {"KVPOLICY_RULES": str(good) + "\n"},
        "tilde": {"KVPOLICY_RULES": "~"},
        "dash": {"KVPOLICY_RULES": "-"},
        "explain-yes": {"KVPOLICY_RULES": str(good), "KVPOLICY_EXPLAIN": "YES"},
        "explain-2": {"KVPOLICY_RULES": str(good), "KVPOLICY_EXPLAIN": "2"},
        "explain-unicode": {"KVPOLICY_RULES": str(good), "KVPOLICY_EXPLAIN": "\u0661"},
        "shipped-rules-00": {"KVPOLICY_RULES": str(good), "KVPOLICY_SHIPPED_RULES": "00"},
        "shipped-rules-0-with-dir": {"KVPOLICY_RULES": str(good), "KVPOLICY_SHIPPED_RULES": "0"},
        "version-0.34": {"KVPOLICY_RULES": "shipped", "KVPOLICY_VLLM_VERSION": "0.34"},
        "version-v0.34.0": {"KVPOLICY_RULES": "shipped", "KVPOLICY_VLLM_VERSION": "v0.34.0"},
        "version-newline": {"KVPOLICY_RULES": "shipped", "KVPOLICY_VLLM_VERSION": "0.34.0\n"},
        "version-0.99": {"KVPOLICY_RULES": "shipped", "KVPOLICY_VLLM_VERSION": "0.99.0"},
        "version-10k": {"KVPOLICY_RULES": "shipped", "KVPOLICY_VLLM_VERSION": "9" * 10000},
        "version-huge-int": {"KVPOLICY_RULES": "shipped", "KVPOLICY_VLLM_VERSION": "0." + "9" * 5000 + ".0"},
        "version-local": {"KVPOLICY_RULES": "shipped", "KVPOLICY_VLLM_VERSION": "0.34.0+cu129"},
        "version-profile-space": {"KVPOLICY_RULES": "shipped", "KVPOLICY_VLLM_VERSION": " vllm-0.34 "},
        "version-and-profile-disagree": {"KVPOLICY_RULES": "shipped", "KVPOLICY_VLLM_VERSION": "0.34.0",
                                         "KVPOLICY_VLLM_PROFILE": "vllm-0.28"},
        "profile-garbage": {"KVPOLICY_RULES": "shipped", "KVPOLICY_VLLM_PROFILE": "\u202e43.0-mllv"},
    }
    return c


# ---------------------------------------------------------------- vLLM objects, called directly

class RaisingMapping(Mapping):
    def __getitem__(self, k):
        raise KeyError(k)

    def __iter__(self):
        raise RuntimeError("iteration broke")

    def __len__(self):
        return 1


class BadKey(str):
    def __repr__(self):
        raise RuntimeError("repr broke")

    def encode(self, *a, **k):
        raise RuntimeError("encode broke")


class EvilStr(str):
    def __eq__(self, other):
        raise RuntimeError("eq")

    __hash__ = str.__hash__


def extra_cases() -> dict:
    big_list = list(range(1_000_000))
    wide = {f"k{i}": i for i in range(200_000)}
    return {
        "OrderedDict": OrderedDict(a=1),
        "defaultdict": defaultdict(list, a=[1]),
        "UserDict": UserDict(a=1),
        "MappingProxy": types.MappingProxyType({"a": 1}),
        "raising-Mapping": RaisingMapping(),
        "str-subclass-key": {BadKey("x"): 1},
        "evil-eq-key": {EvilStr("transfer_mode"): "push"},
        "list-1e6": {"a": big_list},
        "wide-2e5-keys": wide,
        "str-10MB": {"a": "x" * 10_000_000},
        "tuple-key-nested": {"connectors": ({"kv_connector": "NixlConnector"},)},
        "members-not-dicts": {"connectors": ["NixlConnector"]},
        "members-name-int": {"connectors": [{"kv_connector": 5}]},
        "enable-cross-nan": {"enable_cross_layers_blocks": math.nan},
        "transfer-mode-bytes": {"transfer_mode": b"push"},
        "None": None,
        "list-not-map": ["a"],
        "str-not-map": "enable_cross_layers_blocks=true",
    }


NAMES = ["OffloadingConnector", "NixlConnector", "MultiConnector", "X" * 129, "X" * 5000, "Nixl\x00Connector",
         "\ud800", " MultiConnector", "", "1Connector", "Connector-with-dash", "NixlConnector\n"]


def direct() -> None:
    from fake_vllm import fake_vllm  # noqa
    from test_vllm import KVConnectorBase_V1, group, one
    from test_vllm_plugin import FLASHINFER, FullAttentionSpec, config

    from kvpolicy.engine import LayoutEngine
    from kvpolicy.engine.integrations.vllm import StartupError, use_uniform_kv_cache
    from kvpolicy.engine.integrations.vllm_resolver import resolve
    from kvpolicy.policy.errors import NoLayoutError

    gate_engine, res_engine = LayoutEngine.default("vllm-0.28"), LayoutEngine.default("vllm-0.34")

    def conn(name, extra):
        c = KVConnectorBase_V1.__new__(KVConnectorBase_V1)
        c._kv_transfer_config = types.SimpleNamespace(kv_connector=name, kv_connector_extra_config=extra)
        return c

    def check(case, fn, ok_types):
        try:
            out = fn()
            good = isinstance(out, ok_types) or out is None
            report(case, good, f"answered {out!r:.60}")
        except (StartupError, NoLayoutError) as e:
            report(case, True, f"{type(e).__name__}: {e.render().splitlines()[-1][:100] if hasattr(e, 'render') else e}")
        except RecursionError as e:
            report(case, False, f"RecursionError escaped", f"python hostile/class4_plugin.py  ({case})")
        except Exception as e:
            if str(e) in ("iteration broke", "encode broke", "repr broke"):  # the hostile object's own exception
                report(case, True, f"the object's own {type(e).__name__} ({e}) propagates: not kvpolicy's (vLLM's "
                       "KVTransferConfig hands a plain dict)")
            else:
                report(case, False, f"{type(e).__name__} escaped: {str(e)[:120]}",
                       f"python hostile/class4_plugin.py  ({case})")

    for en, extra in extra_cases().items():
        for name in ("NixlConnector", "MultiConnector"):
            check(f"c4/gate/extra/{en}/{name}", lambda: use_uniform_kv_cache(one(), conn(name, extra), engine=gate_engine), bool)
            check(f"c4/resolver/extra/{en}/{name}",
                  lambda: resolve(res_engine, config(name, None) if extra is None else
                                  types.SimpleNamespace(**{**vars(config(name, {})), "kv_transfer_config": types.SimpleNamespace(
                                      kv_connector=name, kv_connector_extra_config=extra)}),
                                  [FLASHINFER], [FullAttentionSpec()]).layout, object)
    for name in NAMES:
        check(f"c4/gate/name/{name[:20]!r}", lambda: use_uniform_kv_cache(one(), conn(name, {}), engine=gate_engine), bool)
        check(f"c4/resolver/name/{name[:20]!r}", lambda: resolve(res_engine, config(name, {}), [FLASHINFER],
                                                                [FullAttentionSpec()]).layout, object)
    # what vLLM's own get_required_kvcache_layout answers for a connector the rules do not know
    for ans in ["HND", "hnd", "NHD ", "LBHNC", "XYZ", None, 5, b"HND", ["HND"], math.nan, "H\x00ND", "\ud800"]:
        check(f"c4/resolver/connector-layout/{ans!r:.20}",
              lambda: resolve(res_engine, config("ThirdPartyConnector", {}), [FLASHINFER], [FullAttentionSpec()],
                              connector_layouts=lambda: [("ThirdPartyConnector", ans)]).layout, object)
    # worker reports
    for sl in ([], [[]], [["LBHNC", None]], [["lbhnc"]], [["LBHNC"] * 100000], "LBHNC", [["LBHNC"], "LBHNC"],
               [[b"LBHNC"]], [["HND"]], [[5]], None):
        check(f"c4/resolver/supported/{str(sl)[:30]}",
              lambda: resolve(res_engine, config(), sl, [FullAttentionSpec()]).layout, object)
    # specs
    for field, v in [("num_kv_heads", 0), ("num_kv_heads", -1), ("num_kv_heads", 10**30), ("num_kv_heads", 2.5),
                     ("num_kv_heads", True), ("head_size", math.nan), ("block_size", 0), ("block_size", 2**63),
                     ("dtype", "torch.complex64"), ("dtype", None), ("dtype", 5), ("page_size_padded", -5),
                     ("page_size_padded", 10**20), ("scale_bytes", -1), ("num_head_slots", 0)]:
        spec = FullAttentionSpec()
        try:
            setattr(spec, field, v)
        except Exception:
            object.__setattr__(spec, field, v)
        check(f"c4/resolver/spec/{field}={v!r:.20}",
              lambda: resolve(res_engine, config(), [FLASHINFER], [spec]).layout, object)
    for lay in ["lbhnc", "", " HND", "NHD\n", "\ud800", "x" * 10000]:
        check(f"c4/resolver/VLLM_KV_CACHE_LAYOUT={lay[:12]!r}",
              lambda: resolve(res_engine, config(), [FLASHINFER], [FullAttentionSpec()], vllm_kv_cache_layout=lay).layout, object)
    for cap in [-1, 10**100, "90", True, 9.0, math.nan]:
        check(f"c4/resolver/capability={cap!r:.12}",
              lambda: resolve(res_engine, config(), [FLASHINFER], [FullAttentionSpec()], device_capability=cap).layout, object)


def main() -> None:
    direct()
    base = Path(tempfile.mkdtemp(prefix="host23-c4env-"))
    for name, env in env_cases(base).items():
        for flavor in ("0.34", "0.28"):
            r = register_in_child(env, flavor, timeout=15 if name == "fifo-global" else 240)
            good = r.get("ok") or r.get("documented")
            why = (f"active in {r['seconds']:.1f} s" if r.get("ok") else f"{r['type']}: {r['text'][:140]!r}")
            if name == "newline-path" and r.get("ok"):
                why += " (surrounding whitespace of KVPOLICY_RULES trimmed; the log names the directory read)"
            if r.get("ok") and r["seconds"] > 20:  # every vLLM process runs register() at start-up
                good, why = False, (f"register() took {r['seconds']:.0f} s wall (shared machine) in a process "
                                    f"that only loads an empty rule directory: {why}")
            if name in ("nonexistent", "a-file", "fifo-global", "dev-zero-global", "global-is-dir", "dangling-global",
                        "component-256", "non-utf8-path", "newline-path", "explain-2", "explain-unicode",
                        "shipped-rules-00", "version-10k", "version-and-profile-disagree", "profile-garbage",
                        "dev-urandom-connector", "symlink-loop") and r.get("ok") and name != "newline-path":
                good, why = False, f"register() succeeded silently: {r.get('status')}"
            report(f"c4/env/{name}/{flavor}", bool(good), why,
                   f"python hostile/class4_plugin.py  (env case {name}: {json.dumps(env)[:120]})")
    summary("4")


if __name__ == "__main__":
    main()
