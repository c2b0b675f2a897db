"""A spec size given as a subclass of ``int`` or ``float`` (an IntEnum, a wrapper type of the caller's) is
read as its base value: valid, the spec it says; invalid, a located `InputError` naming the field, never a
KeyError from looking the value's own type up (issue 32)."""

from __future__ import annotations

import enum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy.engine.inputs import DEFAULT_EXAMPLE, build_context
from kvpolicy.policy.errors import InputError
from kvpolicy.policy.spec import KVCacheSpec, make_model


class Count(int):
    pass


class Size(float):
    pass


class Heads(enum.IntEnum):
    none = 0
    two = 2


FIELDS = ("num_layers", "block_size", "num_kv_heads", "head_size")
BASE = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64}


@given(field=st.sampled_from(FIELDS), value=st.integers(min_value=-10, max_value=10_000),
       wrap=st.sampled_from([Count, Size]))
def test_a_number_subclass_reads_as_its_base_value(field: str, value: int, wrap: type) -> None:
    plain = float(value) if wrap is Size else value
    try:
        expected = make_model(KVCacheSpec, "spec", {**BASE, field: plain})
    except InputError as exc:
        with pytest.raises(InputError) as got:
            make_model(KVCacheSpec, "spec", {**BASE, field: wrap(value)})
        assert [d.render() for d in got.value.diagnostics] == [d.render() for d in exc.diagnostics]
        assert got.value.diagnostics[0].file == f"spec.{field}"
    else:
        assert make_model(KVCacheSpec, "spec", {**BASE, field: wrap(value)}) == expected


def test_an_int_enum_of_zero_is_a_located_error_in_the_library() -> None:
    spec = {**DEFAULT_EXAMPLE["spec"], "num_kv_heads": Heads.none}
    with pytest.raises(InputError) as exc:
        build_context(spec=spec, vllm_version="vllm-0.34", kv_cache_dtype="auto")
    assert exc.value.diagnostics[0].file == "spec.num_kv_heads"
    assert "got integer `0`" in exc.value.diagnostics[0].message
    ok = build_context(spec={**spec, "num_kv_heads": Heads.two}, vllm_version="vllm-0.34", kv_cache_dtype="auto")
    assert ok.groups.primary.num_kv_heads == 2
