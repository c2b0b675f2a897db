"""The name a user most likely meant: for "did you mean" in errors about backends, operators and literals.

``difflib`` alone ranks by shared characters, so ``FLASH_ATTENTION`` came out nearer ``FLEX_ATTENTION``
than ``FLASH_ATTN`` (vLLM's name). Names are compared in a canonical form first: upper case, ``-`` as
``_``, the spelled-out words vLLM abbreviates (``ATTENTION`` -> ``ATTN``) abbreviated, and vLLM's
historical suffixes (``_VLLM_V1``, ``_BACKEND``) dropped; then a name that is a whole-word prefix of
exactly one choice (``TRITON`` -> ``TRITON_ATTN``); then difflib on the canonical forms.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

__all__ = ["OPERATOR_SYNONYMS", "nearest", "nearest_operator"]

_WORDS = {"ATTENTION": "ATTN", "FLASHATTENTION": "FLASH_ATTN", "FLASHATTN": "FLASH_ATTN"}
_SUFFIXES = ("_VLLM_V1", "_V1", "_BACKEND")

# what other policy languages (OPA, Kyverno, Cedar, JSONLogic, Mongo) call the operators
OPERATOR_SYNONYMS = {
    "equals": "eq", "equal": "eq", "is": "eq", "==": "eq", "=": "eq",
    "not_equals": "ne", "not_equal": "ne", "neq": "ne", "!=": "ne", "is_not": "ne",
    "greater_than": "gt", "greater": "gt", ">": "gt",
    "greater_than_or_equal": "ge", "greater_or_equal": "ge", "gte": "ge", ">=": "ge",
    "less_than": "lt", "less": "lt", "<": "lt",
    "less_than_or_equal": "le", "less_or_equal": "le", "lte": "le", "<=": "le",
    "one_of": "in", "any_of": "in", "anyin": "in", "allin": "in", "nin": "not_in", "not_one_of": "not_in",
    "notin": "not_in", "anynotin": "not_in", "present": "exists", "has": "exists", "defined": "exists",
}


def _canon(name: str) -> str:
    text = re.sub(r"[-\s]+", "_", name.strip().upper())
    for suffix in _SUFFIXES:
        if text.endswith(suffix) and len(text) > len(suffix):
            text = text[: -len(suffix)]
    return "_".join(_WORDS.get(word, word) for word in text.split("_"))


def nearest(name: str, choices: Iterable[str]) -> str | None:
    """The choice ``name`` most likely means, or None; never ``name`` itself."""
    options = [c for c in dict.fromkeys(choices) if c != name]
    if not options or not isinstance(name, str) or not name.strip():
        return None
    canon = _canon(name)
    by_canon = {_canon(c): c for c in options}
    if canon in by_canon:
        return by_canon[canon]
    prefixed = [c for k, c in by_canon.items() if k.startswith(canon + "_") or canon.startswith(k + "_")]
    if len(prefixed) == 1:
        return prefixed[0]
    close = difflib.get_close_matches(canon, list(by_canon), n=1, cutoff=0.6)
    return by_canon[close[0]] if close else None


def nearest_operator(key: str, operators: Iterable[str]) -> str | None:
    """The operator an unknown leaf key most likely means (``greater_than`` -> ``gt``), or None."""
    ops = tuple(operators)
    low = key.strip().lower().replace("-", "_")
    if low in ops:
        return low
    if low in OPERATOR_SYNONYMS and OPERATOR_SYNONYMS[low] in ops:
        return OPERATOR_SYNONYMS[low]
    close = difflib.get_close_matches(low, [*ops, *OPERATOR_SYNONYMS], n=1, cutoff=0.75)
    if not close:
        return None
    return close[0] if close[0] in ops else OPERATOR_SYNONYMS[close[0]]
