"""kvpolicy, when this repository's clone is named ``kvpolicy`` and Python runs in the directory holding it.

From there, ``import kvpolicy`` finds the clone before the installed package (the current directory
comes first on ``sys.path``, before an editable install's finder); without this file the clone would
be an empty namespace package and ``from kvpolicy import LayoutEngine`` would fail. The clone's layout
is the installed one (``engine/``, ``policy/``, ``rules/`` are ``kvpolicy.engine``, ``kvpolicy.policy``,
``kvpolicy.rules``), so this file runs the package's own ``kvpolicy/__init__.py`` and adds
``kvpolicy/`` to the search path (for ``python -m kvpolicy``). Not installed: the wheel's ``kvpolicy``
is ``kvpolicy/`` itself.
"""

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
__path__ = [_here, _os.path.join(_here, "kvpolicy")]
_own = _os.path.join(_here, "kvpolicy", "__init__.py")
with open(_own, encoding="utf-8") as _file:
    exec(compile(_file.read(), _own, "exec"))
del _file, _own, _here, _os
