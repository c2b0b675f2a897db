"""A hostile peer's fingerprint data: every malformed value is an `InputError` naming the argument, never a bare
TypeError/ValueError from json or from `LayoutFingerprint.layout`."""

from __future__ import annotations

import json

import pytest

from kvpolicy.engine.agreement import RankFingerprint, agree, check_compatible, compare_ranks
from kvpolicy.engine.fingerprint import LayoutFingerprint, fingerprint_of
from kvpolicy.engine.peer_data import MAX_PEER_BYTES
from kvpolicy.engine.plan import plan_layout
from kvpolicy.policy.backends import BACKENDS
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.layouts import Layout
from kvpolicy.policy.spec import KVCacheSpec


def _fingerprint(layout: Layout = Layout.LBNHC, backend: str = "TRITON_ATTN") -> LayoutFingerprint:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=1 if BACKENDS[backend].mla else 2, head_size=16, block_size=16,
                       dtype="bfloat16", kv_cache_dtype="fp8", kind="mla" if BACKENDS[backend].mla else "full")
    plan = plan_layout(layout, spec, BACKENDS[backend], 5)
    return fingerprint_of(plan.layout, plan.spec, plan.backend)


def _supported() -> list[tuple[str, Layout]]:
    out = []
    for name in BACKENDS:
        for layout in Layout:
            try:
                _fingerprint(layout, name)
            except InputError:  # the backend has no geometry for this layout
                continue
            out.append((name, layout))
    return out


@pytest.mark.parametrize("data", [5, None, 1.5, [1], {}, memoryview(b"{}")],
                         ids=["int", "None", "float", "list", "dict", "memoryview"])
def test_from_json_refuses_what_is_not_json_text_by_name(data: object) -> None:
    with pytest.raises(InputError) as err:
        LayoutFingerprint.from_json(data)  # type: ignore[arg-type]
    assert err.value.diagnostics[0].code == "peer-data"
    assert "fingerprint" in str(err.value)


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1E+999"])
def test_peer_json_refuses_numbers_that_parse_to_infinity(number: str) -> None:
    """Docs: peer JSON is strict, no Infinity; `1e400` is the same value spelled as a number."""
    with pytest.raises(InputError) as err:
        check_compatible(_fingerprint(), f'{{"format_version": {number}}}')
    assert err.value.diagnostics[0].code == "peer-data"


@pytest.mark.parametrize(("placement", "head_order"), [("per\u200b_layer", "NHD"), ("per_layer", "NHDX"),
                                                       ("", ""), ("cross_layer", "per_layer")])
def test_from_dict_refuses_a_placement_that_names_no_layout(placement: str, head_order: str) -> None:
    data = _fingerprint().to_dict() | {"placement": placement, "head_order": head_order}
    with pytest.raises(InputError) as err:
        LayoutFingerprint.from_json(json.dumps(data)).layout  # noqa: B018 - `layout` parses the pair
    assert "fingerprint.placement" in str(err.value)


@pytest.mark.parametrize("field", ["format_version", "num_layers", "page_bytes"])
def test_from_dict_refuses_an_integer_too_long_to_print_located(field: str) -> None:
    """A dict handed to from_dict is bounded as parsed JSON is: an integer past 4,096 bits (Python cannot even
    print one of 4,300 digits) is a located peer-data error, not a bare ValueError."""
    data = _fingerprint().to_dict() | {field: 10**5000}
    with pytest.raises(InputError) as err:
        LayoutFingerprint.from_dict(data)
    assert err.value.diagnostics[0].code == "peer-data" and "integer of 16610 bits" in str(err.value)


def test_a_long_format_version_is_shown_cut_short() -> None:
    data = _fingerprint().to_dict() | {"format_version": 10**1000}
    with pytest.raises(InputError) as err:
        LayoutFingerprint.from_dict(data)
    message = str(err.value)
    assert err.value.diagnostics[0].code == "fingerprint-format" and "..." in message and len(message) < 400


@pytest.mark.parametrize(("backend", "layout"), _supported())
def test_every_supported_layout_round_trips_through_from_json(backend: str, layout: Layout) -> None:
    fp = _fingerprint(layout, backend)
    assert LayoutFingerprint.from_json(fp.to_json()) == fp


@pytest.mark.parametrize("bad", [{1, 2}, b"x", object(), float("nan"), float("-inf")],
                         ids=["set", "bytes", "object", "nan", "-inf"])
def test_compare_ranks_refuses_a_fingerprint_that_is_not_json_by_name(bad: object) -> None:
    ranks = [RankFingerprint(0, 0, {"format_version": bad}), RankFingerprint(1, 1, _fingerprint().to_dict())]
    with pytest.raises(InputError) as err:
        compare_ranks(ranks)
    assert err.value.diagnostics[0].code == "peer-data"
    assert "rank 0" in str(err.value)


def test_check_compatible_refuses_a_dict_with_non_string_keys() -> None:
    fp = _fingerprint().to_dict()
    with pytest.raises(InputError) as err:
        check_compatible(fp, {**fp, 7: "x"})
    assert err.value.diagnostics[0].code == "peer-data"


@pytest.mark.parametrize("bad", [None, {}, "{}", 5, b"{}"], ids=["None", "dict", "str", "int", "bytes"])
def test_agree_refuses_what_is_neither_a_decision_nor_a_fingerprint_by_name(bad: object) -> None:
    with pytest.raises(InputError) as err:
        agree(bad)  # type: ignore[arg-type]
    assert err.value.diagnostics[0].file == "decision"


class _NoCopyText(str):
    def encode(self, *args: object, **kwargs: object) -> bytes:  # type: ignore[override]
        raise AssertionError("a text past the bound was copied to measure it")


def test_a_peer_text_past_the_bound_is_refused_before_it_is_copied() -> None:
    with pytest.raises(InputError) as err:
        LayoutFingerprint.from_json(_NoCopyText(" " * (MAX_PEER_BYTES + 1)))
    assert err.value.diagnostics[0].code == "peer-data"


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), float("-inf"), -1, 0, 0.0, 86_401, 10**400, 1e300,
                                     True, "60", [60], None.__class__],
                         ids=["nan", "inf", "-inf", "-1", "0", "0.0", "over-a-day", "10**400", "1e300", "True",
                              "str", "list", "type"])
def test_agree_refuses_a_timeout_that_is_no_finite_positive_number_by_name(timeout: object) -> None:
    """`timeout_s` is checked before anything waits on it (NaN and infinity were a bare ValueError and
    OverflowError from timedelta), even in a world of one."""
    with pytest.raises(InputError) as err:
        agree(_fingerprint(), timeout_s=timeout)  # type: ignore[arg-type]
    diag = err.value.diagnostics[0]
    assert diag.file == "timeout_s" and "`timeout_s` must be" in diag.message and len(diag.message) < 200
    assert "or None to wait for the process group's own timeout" in (diag.help or "")


@pytest.mark.parametrize("timeout", [None, 0.001, 1, 60.0, 86_400])
def test_agree_takes_none_or_seconds_up_to_a_day(timeout: float | None) -> None:
    fp = _fingerprint()
    assert agree(fp, timeout_s=timeout) == fp


@pytest.mark.parametrize("version", ["1", None, [1], {"v": 1}, "absent"])
def test_a_peer_fingerprint_without_an_integer_format_version_is_the_peers_fault(version: object) -> None:
    """What a peer sent is an `AgreementError` naming its group rank (peer-data), never the `InputError`
    `compare_ranks` gives a caller who passed no fingerprint (issue 23's hostile pass: it escaped agree())."""
    import json

    from kvpolicy.engine.agreement import AgreementError, _rank_from_bytes

    fp = _fingerprint().to_dict()
    fp = {k: v for k, v in fp.items() if k != "format_version"} if version == "absent" else \
        {**fp, "format_version": version}
    data = json.dumps({"rank": 5, "group_rank": 2, "fingerprint": fp, "ruleset_digest": None}).encode()
    with pytest.raises(AgreementError) as err:
        _rank_from_bytes(data, 2)
    diag = err.value.diagnostics[0]
    assert diag.file == "group rank 2" and diag.code == "peer-data"
    assert "group rank 2 sent a fingerprint with no integer `format_version`" in diag.message


def test_a_timeout_just_past_a_day_is_not_shown_as_a_day() -> None:
    with pytest.raises(InputError) as err:
        agree(_fingerprint(), timeout_s=86_400.0000001)
    assert "got `86400.0000001`" in err.value.diagnostics[0].message


@pytest.mark.parametrize("field", ["backend", "kv_cache_dtype", "format_version"])
def test_a_peers_long_value_is_shown_cut_in_every_difference(field: str) -> None:
    """A peer's 500,000-character string (past the 4,000 characters that show a legitimate value, a list of
    40 KV cache groups, whole) was printed whole in `check_compatible`'s differences and in the
    `LayoutMismatchError` every rank logs (issue 23's hostile pass, class 7)."""
    from kvpolicy.engine.agreement import AgreementError

    fp = _fingerprint().to_dict()
    peer = {**fp, field: "x" * 500_000}
    [difference] = check_compatible(fp, peer).messages
    assert len(difference) < 4_200 and "... (500000 characters)" in difference
    if field != "format_version":  # a string format_version is compare_ranks' caller's InputError
        with pytest.raises(AgreementError) as err:
            compare_ranks([RankFingerprint(0, 0, fp), RankFingerprint(1, 1, peer)])
        assert len(err.value.render()) < 6_000


def test_a_peers_unknown_keys_are_shown_cut() -> None:
    fp = _fingerprint().to_dict()
    with pytest.raises(InputError) as err:
        LayoutFingerprint.from_dict({**fp, **{f"{i}" + "e" * 50_000: 1 for i in range(12)}})
    message = err.value.diagnostics[0].message
    assert len(message) < 1_000 and message.endswith("and 2 more")
