"""What the guard modules share: vLLM attributes replaced and put back, and warnings said once.

A guard patches vLLM's classes or modules once per process (`Patches.apply`, or `Patches.record` for a
value it set itself) and `Patches.undo` puts every one back, the newest first, deleting what was not
there before; the plugin's unregister calls each module's ``unguard``, which calls it. `WarnOnce` says
a warning once per key (a connector created again says nothing new).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["Patches", "WarnOnce"]

_MISSING = object()


class Patches:
    """The (owner, attribute, value before) of every replacement, in the order made."""

    def __init__(self) -> None:
        self._made: list[tuple[Any, str, Any]] = []

    def __len__(self) -> int:
        return len(self._made)

    def record(self, owner: Any, attr: str, original: Any) -> None:
        """A replacement the caller made itself; ``original`` is what `undo` puts back."""
        self._made.append((owner, attr, original))

    def apply(self, owner: Any, attr: str, value: Any) -> None:
        """Replace ``owner.attr`` by ``value`` (a class's own attribute: an inherited one is deleted on undo)."""
        self.record(owner, attr, owner.__dict__.get(attr, _MISSING) if isinstance(owner, type)
                    else getattr(owner, attr))
        setattr(owner, attr, value)

    def undo(self) -> None:
        """Put back every replaced attribute, the newest first."""
        while self._made:
            owner, attr, original = self._made.pop()
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


class WarnOnce(set):
    """The keys already warned about (a set: ``clear()`` lets them be said again)."""

    def __init__(self, log: logging.Logger) -> None:
        super().__init__()
        self.log = log

    def __call__(self, key: str, message: str, *args: Any) -> None:
        if key not in self:
            self.add(key)
            self.log.warning(message, *args)
