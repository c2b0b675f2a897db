"""ExampleConnector's store, kept per stamp: see `kvpolicy.engine.integrations.vllm_exchange`.

ExampleConnector (vLLM 0.24 on, ``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``)
stores one safetensors file per layer per prompt under ``shared_storage_path``, in a folder named
by a hash of the prompt's token ids; its lookup (``_found_match_for_prompt``) only asks whether that
folder exists, on the scheduler side, and its save and load (worker side) name files under
``_storage_path``. The guard moves ``_storage_path`` into the stamp's folder on both sides and wraps
the lookup, so a miss there is reported (another stamp's entries, or unstamped ones) or, for
unstamped entries under ``accept``, taken.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvpolicy.engine.agreement import check_compatible
from kvpolicy.engine.integrations.vllm_exchange import (
    ENV_UNSTAMPED,
    NAMESPACE_PREFIX,
    STAMP_FILE,
    Stamp,
    read_stamp,
    write_atomically,
)
from kvpolicy.policy.errors import input_error, shown

__all__ = ["MAX_OTHER_FOLDERS", "ExampleConnectorGuard", "guard"]

log = logging.getLogger("vllm.kvpolicy")
MAX_OTHER_FOLDERS = 64  # other stamps' folders a miss looks into, the most recently changed first


def _cut(text: str, limit: int = 300) -> str:
    """Text another tenant controls, as a log line carries it: control characters escaped, cut to ``limit``."""
    text = shown(text).encode("unicode_escape").decode("ascii") if not text.isprintable() else shown(text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


class ExampleConnectorGuard:
    """ExampleConnector's store, kept per stamp (see the module docstring). Applied to one connector
    object: its storage path becomes the stamp's folder, and its lookup reports other stamps' entries."""

    def __init__(self, connector: Any, stamp: Stamp, unstamped: str) -> None:
        self.root = Path(str(connector._storage_path))
        self.stamp = stamp
        self.unstamped = unstamped
        self.folder = self.root / stamp.namespace
        self.reported: set[str] = set()
        self._listed: tuple[float, list[Path]] | None = None
        self._claim_folder()
        self._align = sys.modules[type(connector).__module__].align_to_block_size  # vLLM's own rounding
        self._block_size = int(connector._block_size)
        self._found = connector._found_match_for_prompt
        self._folder_of = connector._generate_foldername_debug
        connector._storage_path = str(self.folder)
        connector._found_match_for_prompt = self.found_match_for_prompt
        connector.kvpolicy_guard = self

    def _claim_folder(self) -> None:
        """Create the stamp's folder with its stamp.json, or check the one there is this stamp; a folder that
        is a link (another tenant's pointer elsewhere), or one that cannot be made, stops start-up located."""
        where = "kv_transfer_config.kv_connector_extra_config.shared_storage_path"
        try:
            if self.folder.is_symlink():
                raise input_error(where, f"the store folder {shown(str(self.folder))} of this engine's stamp is a "
                                  "symbolic link: entries written there would land wherever it points",
                                  "remove the link (kvpolicy makes the folder itself)", code="stamp-mismatch")
            self.folder.mkdir(parents=True, exist_ok=True)
            exists = (self.folder / STAMP_FILE).exists() or (self.folder / STAMP_FILE).is_symlink()
            there = read_stamp(self.folder) if exists else None
            if there is None:
                write_atomically(self.folder / STAMP_FILE, json.dumps(self.stamp.to_dict(), indent=1,
                                                                      sort_keys=True))
        except OSError as exc:
            raise input_error(where, f"cannot keep this engine's entries in {shown(str(self.folder))}: "
                              f"{exc.strerror or exc}", "give the engine a store it can write (or unset "
                              "KVPOLICY_RULES to run unchecked)", code="store-unwritable") from None
        if there is not None and (isinstance(there, str) or there.view_digest != self.stamp.view_digest):
            why = there if isinstance(there, str) else f"it is stamped {there.view_digest}"
            raise input_error("kv_transfer_config.kv_connector_extra_config.shared_storage_path",
                              f"the store folder {self.folder} is named for this engine's stamp "
                              f"{self.stamp.view_digest}, but {why}", "move that folder away (nothing reads it)",
                              code="stamp-mismatch")

    def found_match_for_prompt(self, prompt_token_ids: list[int], mm_hashes: list[str]) -> bool:
        """ExampleConnector's lookup in this engine's folder; on a miss, other stamps' entries for the
        prompt are reported (once per folder), and an unstamped one is taken under ``accept``. Nothing
        another tenant put in the store makes it raise: the scheduler calls it, and a raise stops vLLM."""
        if self._found(prompt_token_ids, mm_hashes):
            return True
        try:
            return self._look_elsewhere(Path(self._entry(prompt_token_ids, mm_hashes)).name)
        except Exception as exc:  # INVARIANT: a miss, never a crash (and never a hit we cannot vouch for)
            log.warning("kvpolicy: ExampleConnector: looking for this prompt's blocks elsewhere in the store %s "
                        "failed (%s: %s); a miss: vLLM recomputes them", shown(str(self.root)),
                        type(exc).__name__, _cut(str(exc)))
            return False

    def _look_elsewhere(self, entry: str) -> bool:
        for other in self._other_folders():
            if str(other) in self.reported and not (other == self.root and self.unstamped == "accept"):
                continue  # said once already: a miss costs no more look-ups there
            try:
                if not (other / entry).is_dir():
                    continue
            except OSError:  # a folder this engine may not look into: nothing it can use there
                continue
            if other == self.root:
                if self.unstamped == "accept":
                    return self._adopt(other / entry)
                self._report(other, "entries no kvpolicy stamped (an engine without kvpolicy wrote them); "
                             f"{ENV_UNSTAMPED}=accept takes them as this engine's own")
            else:
                self._report(other, self._differences(other))
        return False

    def _entry(self, prompt_token_ids: list[int], mm_hashes: list[str]) -> str:
        """The folder ExampleConnector names for the prompt's whole blocks (as its own lookup does)."""
        import torch

        aligned = self._align(len(prompt_token_ids) - 1, self._block_size)
        return self._folder_of(torch.tensor(prompt_token_ids)[:aligned], mm_hashes, create_folder=False)

    def _other_folders(self) -> list[Path]:
        """The store's top (unstamped entries) and other stamps' folders, listed at most once a second and
        at most `MAX_OTHER_FOLDERS` of them, the most recently changed first (a miss must not cost a look
        into every folder of a store many engines share; the miss itself is what keeps the bytes safe)."""
        now = time.monotonic()
        if self._listed is None or now - self._listed[0] > 1.0:
            found = []
            try:
                with os.scandir(self.root) as it:
                    for e in it:
                        if e.name.startswith(NAMESPACE_PREFIX) and e.path != str(self.folder):
                            try:
                                if e.is_dir(follow_symlinks=False):
                                    found.append((e.stat(follow_symlinks=False).st_mtime, e.path))
                            except OSError:
                                continue
            except OSError:
                pass
            newest = sorted(found, reverse=True)[:MAX_OTHER_FOLDERS]
            self._listed = (now, [self.root, *(Path(p) for _, p in newest)])
        return self._listed[1]

    def _differences(self, other: Path) -> str:
        there = read_stamp(other)
        if isinstance(there, str):
            return f"blocks this engine cannot interpret: {there}"
        result = check_compatible(self.stamp.fingerprint, there.fingerprint, local_name="ours", remote_name="theirs")
        fields = "; ".join(result.messages) or "the same fingerprint under another stamp format"
        writer = f" by vLLM {there.vllm_version}" if there.vllm_version else ""
        return f"blocks written{writer} under another layout: {fields}"

    def _report(self, other: Path, why: str) -> None:
        if str(other) in self.reported:
            return
        self.reported.add(str(other))
        # INVARIANT: what another tenant wrote (folder names, a stamp's strings) reaches the log escaped and cut
        log.warning("kvpolicy: ExampleConnector: the store %s holds this prompt's blocks in %s, %s; they are not "
                    "decoded as this engine's (vLLM recomputes them; this engine's entries go to %s)",
                    shown(str(self.root)), _cut(str(other)), _cut(why, 2000), shown(str(self.folder)))

    def _adopt(self, entry: Path) -> bool:
        """Link an unstamped entry into this engine's folder (``accept``); False if that fails. Only a real
        folder of regular files is taken (never a link out of the store), and it appears in this engine's
        folder whole or not at all (linked into a scratch folder, then renamed into place)."""
        target = self.folder / entry.name
        scratch = self.folder / f".adopting-{entry.name}-{os.getpid()}"
        try:
            if entry.is_symlink() or not entry.is_dir():
                raise OSError(f"{entry.name} is not a folder of the store")
            files = list(os.scandir(entry))
            if not files or any(not f.is_file(follow_symlinks=False) for f in files):
                raise OSError("it holds something other than regular files")
            scratch.mkdir()
            for f in files:
                os.link(f.path, scratch / f.name, follow_symlinks=False)
            os.rename(scratch, target)
        except OSError as exc:
            for f in scratch.glob("*"):
                f.unlink(missing_ok=True)
            if scratch.is_dir():
                scratch.rmdir()
            log.warning("kvpolicy: ExampleConnector: cannot take the unstamped entry %s (%s); vLLM recomputes",
                        _cut(str(entry)), _cut(str(exc.strerror or exc)))
            return target.is_dir()  # another engine of this stamp may have taken it meanwhile
        if str(self.root) not in self.reported:
            self.reported.add(str(self.root))
            log.warning("kvpolicy: ExampleConnector: %s=accept: entries no kvpolicy stamped in %s are taken as "
                        "this engine's own (linked into %s)", ENV_UNSTAMPED, self.root, self.folder)
        return True


def guard(connector: Any, stamp: Stamp, unstamped: str) -> ExampleConnectorGuard:
    """Guard one ExampleConnector object (scheduler or worker side)."""
    return ExampleConnectorGuard(connector, stamp, unstamped)
