# ruff: noqa  (hostile-pass scripts, not product code)
"""Class 7: LayoutFingerprint.from_dict / from_json and check_compatible / compare_ranks / the `compat`
verb with hostile peer values: huge ints, deep nesting, wrong types, NaN, bools as ints, extra keys,
huge strings. Only InputError/LayoutMismatchError may come out, and messages stay bounded (< 10 KB).
Run: python hostile/class7_fingerprint.py"""
from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import report, summary

from kvpolicy.engine import LayoutEngine
from kvpolicy.engine.agreement import RankFingerprint, check_compatible, compare_ranks
from kvpolicy.engine.fingerprint import LayoutFingerprint
from kvpolicy.policy.errors import PolicyError

D = LayoutEngine.default("vllm-0.34").decide(spec={"num_layers": 4, "num_kv_heads": 2, "head_size": 64})
FP = D.fingerprint.to_dict()
MAX_MSG = 10_000


def variants() -> dict:
    out = {}
    for k, v in FP.items():
        if k == "groups":
            continue
        for label, new in [("huge-int", 2 ** 4000), ("neg", -1), ("zero", 0), ("bool", True), ("float", 4.0),
                           ("nan", math.nan), ("inf", math.inf), ("str", "4"), ("null", None), ("list", [1]),
                           ("dict", {"a": 1}), ("str-500k", "x" * 500_000), ("surrogate", "\ud800"),
                           ("nul", "a\0b"), ("deep", [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]])]:
            out[f"{k}={label}"] = {**FP, k: new}
    g = FP["groups"][0]
    out["groups=empty"] = {**FP, "groups": []}
    out["groups=extra-key"] = {**FP, "groups": [{**g, "evil": 1}]}
    out["groups=missing-key"] = {**FP, "groups": [{k: v for k, v in g.items() if k != "kind"}]}
    out["groups=item-not-dict"] = {**FP, "groups": [5]}
    out["groups=bool-layers"] = {**FP, "groups": [{**g, "num_layers": True}]}
    out["groups=huge"] = {**FP, "groups": [{**g, "page_bytes": 2 ** 4000}]}
    out["groups=99k"] = {**FP, "groups": [g] * 14_000}
    out["groups=str-keys-int"] = {**FP, "groups": [{**g, 5: 1}]}
    out["extra-key"] = {**FP, "evil": 1}
    out["extra-key-huge"] = {**FP, "e" * 100_000: 1}
    out["digest=int"] = {**FP, "digest": 5}
    out["digest=huge"] = {**FP, "digest": "d" * 900_000}
    out["digest=list"] = {**FP, "digest": [1]}
    out["physical_shape=mixed"] = {**FP, "physical_shape": [4, "B", "X", 2, 2, 64]}
    out["physical_shape=float"] = {**FP, "physical_shape": [4, "B", 64.0, 2, 2, 64]}
    out["physical_shape=long"] = {**FP, "physical_shape": [4, "B"] + [1] * 50_000}
    out["physical_dims=dup"] = {**FP, "physical_dims": ["layer", "layer", "token", "head", "kv", "dim"]}
    out["physical_dims=unknown"] = {**FP, "physical_dims": ["evil", "block", "token", "head", "kv", "dim"]}
    out["dims-mismatch-shape"] = {**FP, "physical_shape": [4, "B", 64]}
    out["cell-bytes-inconsistent"] = {**FP, "cell_bytes": 1, "page_bytes": 3}
    out["num_kv_heads-mismatch-shape"] = {**FP, "num_kv_heads": 99}
    return out


def bounded(e: BaseException) -> tuple[bool, str]:
    text = e.render() if hasattr(e, "render") else str(e)
    return len(text) < MAX_MSG, f"{type(e).__name__} ({len(text)} chars): {text.splitlines()[0][:90]}"


def main() -> None:
    semantic = {"num_layers=neg", "num_layers=zero", "cell-bytes-inconsistent", "num_kv_heads-mismatch-shape",
                "dims-mismatch-shape", "physical_shape=long", "groups=empty"}
    for name, data in variants().items():
        # 1. from_dict of the dict as handed over
        try:
            fp = LayoutFingerprint.from_dict(data)
            positive = ("num_layers", "block_size", "num_kv_heads", "head_size", "cell_bytes", "page_bytes", "kv_factor",
                        "num_buffers")
            nonsense = name in semantic or any(name in (f"{f}=neg", f"{f}=zero") for f in positive) or name in (
                "scale_bytes=neg", "scale_offset=neg")
            if nonsense:
                ok, why = False, (f"accepted a fingerprint no layout has ({name}): low severity, no exception; it then "
                                  "differs from every real one")
            elif name in ("extra-key",) or "nan" in name or "inf" in name:
                ok, why = False, "accepted"
            else:
                ok, why = True, "accepted (a value of the right type)"
            # whatever was accepted must compare and describe without raising
            try:
                check_compatible(FP, fp)
                str(fp)
            except PolicyError:
                pass
            except Exception as e:
                ok, why = False, f"accepted, then check_compatible raised {type(e).__name__}: {e!s:.80}"
        except PolicyError as e:
            ok, why = bounded(e)
        except Exception as e:
            ok, why = False, f"{type(e).__name__} escaped: {str(e)[:100]}"
        report(f"c7/from_dict/{name}", ok, why, f"python hostile/class7_fingerprint.py  (from_dict {name})")
        # 2. the same as JSON text (what a peer sends), through check_compatible
        try:
            text = json.dumps(data, allow_nan=True)
        except (ValueError, TypeError):
            continue
        try:
            r = check_compatible(FP, text)
            msgs = "\n".join(str(d) for d in r.differences)
            ok2 = len(msgs) < MAX_MSG
            why2 = f"compared: ok={r.ok}, {len(r.differences)} differences, {len(msgs)} chars" + (
                "" if ok2 else " (a peer's value printed whole)")
        except PolicyError as e:
            ok2, why2 = bounded(e)
        except Exception as e:
            ok2, why2 = False, f"{type(e).__name__} escaped: {str(e)[:100]}"
        report(f"c7/check_compatible-json/{name}", ok2, why2, f"python hostile/class7_fingerprint.py  (json {name})")
    # compare_ranks on the dicts, as agree() hands peers' dicts
    for name, data in list(variants().items())[::7]:
        try:
            compare_ranks([RankFingerprint(0, 0, FP), RankFingerprint(1, 1, data)])
            ok, why = True, "agreed"
        except PolicyError as e:
            ok, why = bounded(e)
        except Exception as e:
            ok, why = False, f"{type(e).__name__} escaped: {str(e)[:100]}"
        report(f"c7/compare_ranks/{name}", ok, why, f"python hostile/class7_fingerprint.py  (compare_ranks {name})")
    summary("7")


if __name__ == "__main__":
    main()
