"""Machine-readable renderings of located diagnostics: JSON documents, GitHub annotations, SARIF.

Every verb's ``--format json`` document starts with ``format_version``
(docs/json-output.md); ``--format github`` and ``--format sarif`` (``validate``,
``lint``) turn the project's `Diagnostic`s into what CI systems read:

- GitHub Actions workflow commands, one a line:
  ``::error file=rules/global.yaml,line=12,col=5,title=unknown-field::unknown field ...``.
  Values are escaped as the Actions runner unescapes them (actions/toolkit
  ``command.ts``): ``%``, CR and LF in the message; also ``:`` and ``,`` in
  properties. A diagnostic without a position (``line`` 0) names no line.
- SARIF 2.1.0 (OASIS), one run whose rules are the diagnostic codes; a file's
  ``artifactLocation.uri`` is its name's bytes percent-encoded (RFC 3986), so a
  name that is not UTF-8 keeps every byte.

JSON never holds NaN or infinities (``allow_nan=False``): a value JSON cannot
carry is a bug to surface, not a document other parsers reject. Nor does it hold
lone surrogates: a file name that is not UTF-8 (a legal name on Linux) reaches
every document, SARIF's and GitHub's texts as `kvpolicy.policy.errors.shown`
writes it (``bad\\xff.yaml``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Literal
from urllib.parse import quote

from kvpolicy.policy.errors import Diagnostic, shown

__all__ = [
    "FORMAT_VERSION",
    "SARIF_SCHEMA",
    "Severity",
    "github_annotations",
    "json_document",
    "json_text",
    "sarif_log",
]

FORMAT_VERSION = 1
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"

Severity = Literal["error", "warning", "note"]
_GITHUB_COMMAND = {"error": "error", "warning": "warning", "note": "notice"}


def json_document(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``format_version`` as its first key (the version of docs/json-output.md's contract)."""
    return {"format_version": FORMAT_VERSION, **{k: v for k, v in data.items() if k != "format_version"}}


def json_text(data: Any) -> str:
    """2-space indented JSON; raises ValueError on NaN or an infinity instead of writing invalid JSON. Every
    string is `shown`: a file name that is not UTF-8 would otherwise be a lone surrogate, which strict JSON
    readers refuse and no UTF-8 stream can carry."""
    return json.dumps(_shown_strings(data), indent=2, allow_nan=False)


def _shown_strings(data: Any) -> Any:
    if isinstance(data, str):
        return shown(data)
    if isinstance(data, dict):
        return {shown(k) if isinstance(k, str) else k: _shown_strings(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_shown_strings(v) for v in data]
    return data


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(findings: Iterable[tuple[Severity, Diagnostic]]) -> str:
    """One GitHub Actions workflow command per diagnostic (``::error``, ``::warning``, ``::notice``)."""
    lines = []
    for severity, d in findings:
        props = [f"file={_escape_property(shown(d.file))}"] if d.file else []
        if d.line > 0:
            props.append(f"line={d.line}")
            if d.col > 0:
                props.append(f"col={d.col}")
        props.append(f"title={_escape_property(shown(d.code))}")
        message = d.message + (f"\nhelp: {d.help}" if d.help else "")
        lines.append(f"::{_GITHUB_COMMAND[severity]} {','.join(props)}::{_escape_data(shown(message))}")
    return "\n".join(lines)


def _name_bytes(path: str) -> bytes:
    """The bytes of a file name as the file system holds them (``os.fsencode`` on Linux): those that are not
    UTF-8 come back from their lone surrogates; any other lone surrogate as UTF-8 would write it."""
    try:
        return path.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return path.encode("utf-8", "surrogatepass")


def _sarif_result(severity: Severity, d: Diagnostic, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"ruleId": d.code, "level": severity,
                              "message": {"text": d.message + (f"\nhelp: {d.help}" if d.help else "")}}
    if d.file:
        where: dict[str, Any] = {"artifactLocation": {"uri": quote(_name_bytes(d.file), safe="/-._~"),
                                                      **(extra or {})}}
        if d.line > 0:
            where["region"] = {"startLine": d.line, **({"startColumn": d.col} if d.col > 0 else {})}
        result["locations"] = [{"physicalLocation": where}]
    return result


def sarif_log(findings: Sequence[tuple[Severity, Diagnostic]], *, tool_version: str,
              extras: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A SARIF 2.1.0 log with one run of the ``kvpolicy`` tool; each distinct code is a reporting rule.
    ``extras``, one per finding, add to its ``artifactLocation`` (``uriBaseId: KVPOLICY_SHIPPED`` for a
    shipped rule file, which the run's ``originalUriBaseIds`` describes: it is not in the repository)."""
    codes = sorted({d.code for _, d in findings})
    driver = {"name": "kvpolicy", "version": tool_version, "rules": [{"id": code} for code in codes]}
    extra = list(extras) if extras is not None else [{} for _ in findings]
    run: dict[str, Any] = {"tool": {"driver": driver}, "columnKind": "unicodeCodePoints",
                           "results": [_sarif_result(s, d, e) for (s, d), e in zip(findings, extra, strict=True)]}
    bases = sorted({e["uriBaseId"] for e in extra if "uriBaseId" in e})
    if bases:
        run["originalUriBaseIds"] = {b: {"description": {"text": "the rules shipped in the kvpolicy package "
                                                                 "(kvpolicy/rules/ where it is installed)"}}
                                     for b in bases}
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}
