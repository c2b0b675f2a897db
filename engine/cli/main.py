"""``kvpolicy``: the entry point. Builds the parser, dispatches, turns errors into exit codes.

Exit codes (docs/cli.md): 0 ok; 1 the policy said no, a test failed, the rules
do not validate; 2 a usage error (a bad flag or an input it names). A user's
mistake prints its located diagnostics, never a traceback. No verb imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvpolicy.engine.cli import (
    analyze,
    compat,
    completion,
    doctor,
    dry_run,
    formatting,
    releases,
    rules_view,
    schema,
    testing,
    validate,
)
from kvpolicy.engine.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    HelpFormatter,
    exit_code_for,
    report_error,
    settle_vllm_version,
    tool_version,
    usage_error,
)
from kvpolicy.policy.errors import PolicyError, terminal_text
from kvpolicy.policy.waivers import TODAY_VARIABLE, parse_day, today_is

__all__ = ["build_parser", "main"]

_EPILOG = """\
examples:
  kvpolicy dry-run                                  # decide for the built-in example, explain why
  kvpolicy dry-run --model ./Qwen2.5-0.5B --kv-cache-dtype fp8_per_token_head \\
      --connector OffloadingConnector --num-blocks 1024
  kvpolicy validate my-rules/                       # every error, located
  kvpolicy inspect my-rules/                        # the rules in force: id, effect, scope, layer, file:line
  kvpolicy fmt --check my-rules/                    # canonical formatting (--write to apply)
  kvpolicy test                                     # the shipped rules' policy tests
  kvpolicy schema > rule-file.schema.json
  kvpolicy lint my-rules/                           # every input checked against the geometry verifier
  kvpolicy diff shipped my-rules/                   # every decision your layer changes, and why
  kvpolicy compat vllm-0.28 vllm-0.34 --block-size 16   # can blocks move between two releases' caches
  KVPOLICY_RULES=shipped kvpolicy doctor --vllm-version 0.34.0   # the vLLM plugin's setup, checked without vLLM

exit codes: 0 ok, 1 the policy said no / a test or validation failed, 2 usage error
"""


class _VersionAction(argparse.Action):
    """``--version``, computed only when asked for (importlib.metadata is not free)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_args: object) -> None:
        print(f"kvpolicy {tool_version()}")
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """argparse, except that help or usage it cannot write (a full disk) is an error, not exit 0."""

    def _print_message(self, message: str, file: object = None) -> None:
        if message and file is not None:
            file.write(message)  # type: ignore[attr-defined]


def build_parser() -> argparse.ArgumentParser:
    """The ``kvpolicy`` parser with one subparser per verb."""
    parser = _Parser(
        prog="kvpolicy",
        description="Declarative KV cache layout policy: decide, explain, validate and test layout rules.",
        epilog=_EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", title="verbs")
    for module in (dry_run, validate, testing, schema, analyze, releases, compat, rules_view, formatting, doctor,
                   completion):
        module.register(verbs)
    parser.set_defaults(cli_parser=parser)  # `kvpolicy completion` reads the whole parser
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvpolicy``; returns the exit code (argparse's own exits included)."""
    real_stdout, real_stderr = sys.stdout, sys.stderr
    # the text and github outputs' one boundary: a file name that is not UTF-8 is printed, not a
    # UnicodeEncodeError; an operator's control characters are shown escaped, never sent to the terminal
    sys.stdout = _Shown(real_stdout) if real_stdout is not None else None
    sys.stderr = _BestEffort(real_stderr)  # a message that cannot be shown must not change the exit code
    try:
        code = _dispatch(argv)
        if sys.stdout is not None:
            sys.stdout.flush()  # a full disk surfaces here, not after main returns
        return code
    except BrokenPipeError:  # `kvpolicy ... | head`: stop quietly, exit 1 as Python itself does on EPIPE
        _silence_stdout()
        return EXIT_FAILED
    except OSError as exc:
        if exc.filename is None:  # writing the output failed (`> /dev/full`): not the user's input
            _silence_stdout()
            print(f"kvpolicy: error[write-failed]: cannot write the output: {exc.strerror or exc}",
                  file=sys.stderr)
            return EXIT_FAILED
        # an unreadable file named on the command line
        print(f"{exc.filename}: error[unreadable]: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    finally:
        sys.stdout, sys.stderr = real_stdout, real_stderr


def _dispatch(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and getattr(args, "verb", None) == "dry-run":  # vLLM's flags typed before `--`, most likely
            report_error(usage_error(extra[0], f"unrecognized arguments: {' '.join(extra)}",
                                     "dry-run's own flags are in `kvpolicy dry-run --help`; the arguments of a "
                                     "`vllm serve` line go after `--`: kvpolicy dry-run [flags] -- MODEL "
                                     f"{' '.join(extra)} ..."), getattr(args, "format", "text"))
            return EXIT_USAGE
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, usage errors: argparse already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    if args.verb is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        settle_vllm_version(args)
        day = None
        if getattr(args, "today", None):
            day = parse_day(args.today, "--today")
        elif hasattr(args, "today") and os.environ.get(TODAY_VARIABLE):  # a bad one fails now, waivers or not
            day = parse_day(os.environ[TODAY_VARIABLE], TODAY_VARIABLE)
        with today_is(day):
            return args.run(args)
    except PolicyError as exc:
        from kvpolicy.engine.cli.fleet_report import FLEET_SUITE

        suite = FLEET_SUITE if getattr(args, "fleet", None) else f"kvpolicy {args.verb}"
        report_error(exc, getattr(args, "format", "text"), suite)
        return exit_code_for(exc)


class _Shown:
    """stdout for one run: every text through `terminal_text` (a file name's bytes that are not UTF-8 as
    ``\\xNN``, control characters escaped), so any UTF-8 stream and terminal can carry it safely; JSON and
    XML hold no raw control character to begin with. Everything else is the stream's own."""

    def __init__(self, stream: object) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(terminal_text(text))  # type: ignore[attr-defined]
        return len(text)

    def write_exact(self, text: str) -> int:
        """File content a program reads back (``kvpolicy fmt FILE > out.yaml``, an editor's ``fmt -``): as it
        is, since an escaped bidi mark or line separator (`\u202e`, legal in YAML) would change the value it
        sits in; escaped only where a person reads it, on a terminal."""
        if getattr(self._stream, "isatty", lambda: False)():
            return self.write(text)
        self._stream.write(text)  # type: ignore[attr-defined]
        return len(text)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


class _BestEffort:
    """stderr for one run: what cannot be written there (a closed or full stream) is dropped; texts through
    `terminal_text`."""

    def __init__(self, stream: object) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            if self._stream is not None:
                self._stream.write(terminal_text(text))  # type: ignore[attr-defined]
        except (OSError, ValueError):
            pass
        return len(text)

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()  # type: ignore[attr-defined]
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the exit flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a real file (captured in tests), or closed
        pass


if __name__ == "__main__":
    sys.exit(main())
