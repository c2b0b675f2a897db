
def test_layout_name_literal_lists_every_accepted_name() -> None:
    from typing import get_args

    from kvpolicy.policy.layouts import LEGACY_NAMES, Layout, LayoutName

    assert set(get_args(LayoutName)) == {x.value for x in Layout} | set(LEGACY_NAMES)


def test_every_input_enum_prints_its_value() -> None:
    """`print(decision.layout.placement)` shows `per_layer`, not `Placement.per_layer` (#15): the
    spelling YAML, JSON and the flags use."""
    from kvpolicy.policy.backends import Dim, KVSplit, ScaleViews
    from kvpolicy.policy.layouts import HeadOrder, Layout, Placement
    from kvpolicy.policy.quant import CacheDtype, ModelDtype, QuantMode
    from kvpolicy.policy.spec import AttentionKind

    for enum in (Placement, HeadOrder, Layout, ModelDtype, CacheDtype, QuantMode, AttentionKind, Dim, ScaleViews,
                 KVSplit):
        for member in enum:
            assert (str(member), f"{member}") == (member.value, member.value), member
