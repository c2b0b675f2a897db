"""The one exception tree of kvpolicy.

Every mistake a user can make (a rule file, a model config, an input flag)
surfaces as a `PolicyError` carrying one or more located `Diagnostic`s::

    PolicyError
     +-- RuleLoadError        rule files that do not parse or validate (all errors at once)
     +-- ModelConfigError     a Hugging Face config.json that cannot describe a KV cache
     +-- InputError           a decide()/build() input that is out of range or unknown
     +-- NoLayoutError        the rules removed every candidate layout (a policy "no")
     +-- GeometryError        a layout whose memory views would overlap, or a plan mismatch
     +-- MissingDependencyError  an optional part used without its extra (the runtime without torch)

Messages follow Cedar's style: lowercase start, no trailing period, user input
in backticks, and a ``help`` line that says what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "Diagnostic",
    "GeometryError",
    "InputError",
    "MissingDependencyError",
    "ModelConfigError",
    "NoLayoutError",
    "PolicyError",
    "RuleLoadError",
    "shown",
    "shown_file",
    "terminal_text",
]


def _shown_char(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, as Python decodes file names (PEP 383)
        return f"\\x{code - 0xDC00:02x}"
    if 0xD800 <= code <= 0xDFFF:  # any other lone surrogate (JSON's "\ud800" escape)
        return f"\\u{code:04x}"
    return char


def shown(text: str) -> str:
    """``text`` as every output can carry it (a UTF-8 terminal or pipe, JSON, SARIF, GitHub annotations):
    a byte of a file name that is not UTF-8, which Python holds as a lone surrogate (``surrogateescape``,
    PEP 383), as ``\\xNN`` (``bad\\xff.yaml``); any other lone surrogate as ``\\udNNN``; else unchanged."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "".join(map(_shown_char, text))
    return text


# C0 controls but tab and newline, DEL, C1 controls, the bidirectional overrides, isolates and marks
# ("Trojan Source", CVE-2021-42574), and the line and paragraph separators (a log viewer or an editor breaks
# the line there, so one diagnostic could show as two): what could move a terminal's cursor, ring it,
# recolour it, reorder what it shows or forge a line. Written as Python writes them (``\x1b``, ``\u202e``).
_TERMINAL_ESCAPES = {
    code: (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    for code in [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0), 0x061C, 0x200E, 0x200F,
                 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
}


def terminal_text(text: str) -> str:
    """``text`` as a terminal or a CI log may show it: `shown`, then every control character that is not a
    tab or a newline escaped (an operator's name holding ESC or BEL cannot recolour, ring or rewrite the
    screen). The one boundary of the text and ``github`` outputs: the CLI's stdout and stderr pass every
    write through it."""
    return shown(text).translate(_TERMINAL_ESCAPES)


def shown_file(path: str) -> str:
    """A file name as a ``file:line:col`` location shows it: `shown`, and its control characters
    (a newline, a tab, an escape) escaped as Python writes them, so that a location stays one line."""
    text = shown(path)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


@dataclass(frozen=True, order=True)
class Diagnostic:
    """One located problem: ``file:line:col: error[code]: message``.

    Lines and columns are 1-based, as editors show them. ``line`` is 0 when the
    problem has no position inside the file (an unreadable file, say).
    """

    file: str
    line: int
    col: int
    code: str
    message: str
    help: str | None = field(default=None, compare=False)

    @property
    def location(self) -> str:
        """``file:line:col`` as printed: the file name `shown_file` (one line, valid text whatever its bytes)."""
        if self.line <= 0:
            return shown_file(self.file)
        return f"{shown_file(self.file)}:{self.line}:{self.col}"

    def render(self) -> str:
        text = f"{self.location}: error[{self.code}]: {self.message}"
        if self.help:
            text += f"\n  help: {self.help}"
        return text

    def to_dict(self) -> dict[str, object]:
        return {
            "file": self.file,
            "line": self.line,
            "col": self.col,
            "code": self.code,
            "message": self.message,
            "help": self.help,
        }


class PolicyError(Exception):
    """Base of every error a user can cause; carries sorted diagnostics."""

    def __init__(self, message: str, diagnostics: list[Diagnostic] | None = None) -> None:
        self.diagnostics: list[Diagnostic] = sorted(diagnostics or [])
        self.message = message
        super().__init__(self.render())

    def render(self) -> str:
        if not self.diagnostics:
            return self.message
        body = "\n".join(d.render() for d in self.diagnostics)
        return f"{self.message}\n{body}" if self.message else body


class RuleLoadError(PolicyError):
    """A rule set failed to load; ``diagnostics`` lists every problem found."""


class ModelConfigError(PolicyError):
    """A model config cannot be turned into KV cache specs."""


class InputError(PolicyError):
    """An input to a decision (flag, keyword, model field) is invalid."""


class NoLayoutError(PolicyError):
    """Every candidate layout was removed; names each rule that removed one."""


class GeometryError(PolicyError):
    """Memory views overlap, or tensors no longer match their plan."""


class MissingDependencyError(PolicyError, ImportError):
    """An optional part of kvpolicy was used without the extra that installs it; names the command.

    Also an `ImportError`, so code that already guards the import keeps working."""


def input_error(where: str, message: str, help: str | None = None, code: str = "invalid-input") -> InputError:
    """An `InputError` about one flag, keyword or field named by ``where``."""
    return InputError("", [Diagnostic(where, 0, 0, code, message, help)])
