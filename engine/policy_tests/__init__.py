"""Policy tests: YAML cases that pin what a rule set decides, run as a library.

`cases` holds the format and its loading (every problem located at
file:line:col); `runner` decides each case and reports failures and rule
coverage. `kvpolicy test` is a thin printer over `run_policy_tests`.
"""

from kvpolicy.engine.policy_tests.cases import (
    CaseFile,
    CaseInput,
    Expect,
    GroupInput,
    LoadedCase,
    PolicyCase,
    PolicyTestError,
    case_files,
    context_for,
    groups_from_data,
    load_cases,
)
from kvpolicy.engine.policy_tests.runner import (
    CaseResult,
    Coverage,
    TestRun,
    coverage_of,
    error_codes,
    run_case,
    run_policy_tests,
)

__all__ = [
    "CaseFile",
    "CaseInput",
    "CaseResult",
    "Coverage",
    "Expect",
    "GroupInput",
    "LoadedCase",
    "PolicyCase",
    "PolicyTestError",
    "TestRun",
    "case_files",
    "context_for",
    "coverage_of",
    "error_codes",
    "groups_from_data",
    "load_cases",
    "run_case",
    "run_policy_tests",
]
