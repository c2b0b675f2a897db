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
from kvpolicy.policy.errors import input_error

__all__ = ["ExampleConnectorGuard", "guard"]

log = logging.getLogger("vllm.kvpolicy")


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
        """Create the stamp's folder with its stamp.json, or check the one there is this stamp."""
        self.folder.mkdir(parents=True, exist_ok=True)
        there = read_stamp(self.folder) if (self.folder / STAMP_FILE).exists() else None
        if there is None:
            write_atomically(self.folder / STAMP_FILE, json.dumps(self.stamp.to_dict(), indent=1, sort_keys=True))
        elif isinstance(there, str) or there.view_digest != self.stamp.view_digest:
            why = there if isinstance(there, str) else f"it is stamped {there.view_digest}"
            raise input_error("kv_transfer_config.kv_connector_extra_config.shared_storage_path",
                              f"the store folder {self.folder} is named for this engine's stamp "
                              f"{self.stamp.view_digest}, but {why}", "move that folder away (nothing reads it)",
                              code="stamp-mismatch")

    def found_match_for_prompt(self, prompt_token_ids: list[int], mm_hashes: list[str]) -> bool:
        """ExampleConnector's lookup in this engine's folder; on a miss, other stamps' entries for the
        prompt are reported (once per folder), and an unstamped one is taken under ``accept``."""
        if self._found(prompt_token_ids, mm_hashes):
            return True
        entry = Path(self._entry(prompt_token_ids, mm_hashes)).name
        for other in self._other_folders():
            if str(other) in self.reported and not (other == self.root and self.unstamped == "accept"):
                continue  # said once already: a miss costs no more look-ups there
            if not (other / entry).is_dir():
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
        """The store's top (unstamped entries) and every other stamp's folder, listed at most once a second
        (a miss must not cost a listing of a store many engines share)."""
        now = time.monotonic()
        if self._listed is None or now - self._listed[0] > 1.0:
            try:
                names = sorted(p for p in self.root.iterdir() if p.name.startswith(NAMESPACE_PREFIX) and p.is_dir())
            except OSError:
                names = []
            self._listed = (now, [self.root, *(p for p in names if p != self.folder)])
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
        log.warning("kvpolicy: ExampleConnector: the store %s holds this prompt's blocks in %s, %s; they are not "
                    "decoded as this engine's (vLLM recomputes them; this engine's entries go to %s)",
                    self.root, other, why, self.folder)

    def _adopt(self, entry: Path) -> bool:
        """Link an unstamped entry into this engine's folder (``accept``); False if that fails."""
        target = self.folder / entry.name
        try:
            target.mkdir(exist_ok=True)
            for f in entry.iterdir():
                if f.is_file() and not (target / f.name).exists():
                    os.link(f, target / f.name)
        except OSError as exc:
            log.warning("kvpolicy: ExampleConnector: cannot take the unstamped entry %s (%s); vLLM recomputes",
                        entry, exc.strerror or exc)
            return False
        if str(self.root) not in self.reported:
            self.reported.add(str(self.root))
            log.warning("kvpolicy: ExampleConnector: %s=accept: entries no kvpolicy stamped in %s are taken as "
                        "this engine's own (linked into %s)", ENV_UNSTAMPED, self.root, self.folder)
        return True


def guard(connector: Any, stamp: Stamp, unstamped: str) -> ExampleConnectorGuard:
    """Guard one ExampleConnector object (scheduler or worker side)."""
    return ExampleConnectorGuard(connector, stamp, unstamped)
