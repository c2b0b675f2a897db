
def test_layout_name_literal_lists_every_accepted_name() -> None:
    from typing import get_args

    from kvpolicy.policy.layouts import LEGACY_NAMES, Layout, LayoutName

    assert set(get_args(LayoutName)) == {x.value for x in Layout} | set(LEGACY_NAMES)
