"""Mutation-testing import map: `kvpolicy.{policy,engine,rules}` are the card's folders beside
``$KVMUT_SRC_ROOT/kvpolicy`` (as setuptools' package-dir maps them in an install), so that the
tests import mutmut's mutated copy in ``mutants/`` with nothing installed. Loaded by a .pth file
that .ci/mutation/run.sh puts in the mutation venv only."""

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

_SUB = {"kvpolicy": "kvpolicy", "kvpolicy.policy": "policy", "kvpolicy.engine": "engine", "kvpolicy.rules": "rules"}


class _SourceTreeFinder:
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        root = os.environ.get("KVMUT_SRC_ROOT")
        if fullname not in _SUB or not root:
            return None
        folder = Path(root) / _SUB[fullname]
        init = folder / "__init__.py"
        if init.is_file():
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(folder)])
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)  # rules/: data, no __init__
        spec.submodule_search_locations = [str(folder)]
        return spec


sys.meta_path.insert(0, _SourceTreeFinder)
