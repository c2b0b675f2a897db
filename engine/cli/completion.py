"""``kvpolicy completion bash|zsh|fish``: a shell completion script generated from the CLI's own parser.

The verbs (and their aliases), each verb's flags, the values of flags that take a closed set (argparse
``choices``; the release profiles and versions for ``--vllm-version``, vLLM's ``kv_cache_dtype`` strings and
the connectors the profiles register for the flags that name them) and files or directories for flags whose
metavar names one are read from `kvpolicy.engine.cli.main.build_parser` when the script is printed, so it
cannot drift from the flags it completes (as ``pip completion``, with no dependency such as argcomplete).
bash and fish get native scripts; zsh runs the bash one through its ``bashcompinit``.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

from kvpolicy.engine.cli.common import EXIT_OK, HelpFormatter

__all__ = ["SHELLS", "Verb", "completion_script", "register", "run", "verbs_of"]

SHELLS = ("bash", "zsh", "fish")

_EPILOG = """\
examples:
  kvpolicy completion bash > kvpolicy.bash        # then into ~/.local/share/bash-completion/completions/kvpolicy
  source <(kvpolicy completion bash)              # this bash session only
  kvpolicy completion zsh > _kvpolicy             # a directory of $fpath; or source <(kvpolicy completion zsh)
  kvpolicy completion fish > kvpolicy.fish        # then into ~/.config/fish/completions/

what completes: verbs, each verb's flags, the values of flags with a closed set (--format, --explain,
--vllm-version, --kv-cache-dtype, --connector, ...), directories for DIR flags and files for FILE/PATH ones;
regenerate after upgrading kvpolicy
"""

# one shell word, safe unquoted in `compgen -W` and in fish's `-a`: anything else is left out, never escaped wrong
_WORD = re.compile(r"^[A-Za-z0-9_.:/+=,@-]+$")


@dataclass
class Flag:
    """One flag of a verb: its spellings, whether it takes a value, the values it completes to."""

    names: list[str]
    takes_value: bool
    values: list[str] = field(default_factory=list)
    files: str = ""  # "dir", "file" or "" (no file completion)
    help: str = ""


@dataclass
class Verb:
    """One verb (aliases share its flags), and what its positional arguments complete to."""

    names: list[str]
    help: str
    flags: list[Flag]
    positional_files: bool


def _closed_sets() -> dict[str, list[str]]:
    """Values for flags argparse leaves open but kvpolicy checks against a known set, by ``dest``."""
    from kvpolicy.policy.connectors import KNOWN_CONNECTORS
    from kvpolicy.policy.quant import KV_CACHE_DTYPES
    from kvpolicy.policy.releases import get_profile, profile_names

    versions = [v for name in profile_names() for v in (name, *get_profile(name).vllm_versions)]
    return {"vllm_version": versions, "kv_cache_dtype": list(KV_CACHE_DTYPES),
            "connector": sorted(KNOWN_CONNECTORS), "via": sorted(KNOWN_CONNECTORS)}


def _help(action: argparse.Action) -> str:
    text = action.help if isinstance(action.help, str) and action.help != argparse.SUPPRESS else ""
    text = text.replace("%%", "%")
    return " ".join(text.split())


def _flag(action: argparse.Action, closed: dict[str, list[str]]) -> Flag:
    takes = action.nargs != 0
    values = [str(c) for c in action.choices] if action.choices is not None else closed.get(action.dest, [])
    metavar = str(action.metavar or "")
    files = "" if values or not takes else "dir" if "DIR" in metavar else "file" if metavar in (
        "FILE", "PATH", "MODULE_PATH") or metavar.endswith("FILE") or metavar.endswith("PATH") else ""
    return Flag(list(action.option_strings), takes, [v for v in values if _WORD.match(v)], files, _help(action))


def verbs_of(parser: argparse.ArgumentParser) -> tuple[list[Flag], list[Verb]]:
    """The top-level flags and every verb of ``parser``, as the scripts complete them."""
    closed = _closed_sets()
    top = [_flag(a, closed) for a in parser._actions if a.option_strings]
    verbs: list[Verb] = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {c.dest: _help(c) for c in action._choices_actions}
        by_parser: dict[int, Verb] = {}
        for name, sub in action.choices.items():
            known = by_parser.get(id(sub))
            if known is not None:  # an alias (`rules` for `inspect`)
                known.names.append(name)
                continue
            flags = [_flag(a, closed) for a in sub._actions if a.option_strings]
            positional = any(not a.option_strings and a.nargs != 0 for a in sub._actions)
            verb = Verb([name], helps.get(name, ""), flags, positional)
            by_parser[id(sub)] = verb
            verbs.append(verb)
    return top, verbs


def _words(items: list[str]) -> str:
    return " ".join(i for i in items if _WORD.match(i))


def _bash(top: list[Flag], verbs: list[Verb]) -> str:
    lines = [
        "# bash completion for kvpolicy: generated by `kvpolicy completion bash` from its own parser",
        "_kvpolicy() {",
        "    local cur prev verb i",
        "    COMPREPLY=()",
        '    cur="${COMP_WORDS[COMP_CWORD]}"',
        '    prev="${COMP_WORDS[COMP_CWORD-1]}"',
        '    verb=""',
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        '        case "${COMP_WORDS[i]}" in',
        "            -*) ;;",
        '            *) verb="${COMP_WORDS[i]}"; break ;;',
        "        esac",
        "    done",
        '    case "$verb" in',
        '        "")',
        f'            COMPREPLY=($(compgen -W "{_words([n for v in verbs for n in v.names])} '
        f'{_words([n for f in top for n in f.names])}" -- "$cur"))',
        "            return 0 ;;",
    ]
    for verb in verbs:
        lines.append(f"        {'|'.join(verb.names)})")
        lines.append('            case "$prev" in')
        for flag in verb.flags:
            if not flag.takes_value:
                continue
            names = "|".join(flag.names)
            if flag.values:
                reply = f'COMPREPLY=($(compgen -W "{_words(flag.values)}" -- "$cur"))'
            elif flag.files == "dir":
                reply = 'COMPREPLY=($(compgen -d -- "$cur"))'
            elif flag.files == "file":
                reply = 'COMPREPLY=($(compgen -f -- "$cur"))'
            else:
                reply = "COMPREPLY=()"
            lines.append(f"                {names}) {reply}; return 0 ;;")
        lines.append("            esac")
        lines.append('            if [[ "$cur" == -* ]]; then')
        lines.append(f'                COMPREPLY=($(compgen -W "{_words([n for f in verb.flags for n in f.names])}" '
                     '-- "$cur"))')
        if verb.positional_files:
            lines.append("            else")
            lines.append('                COMPREPLY=($(compgen -f -- "$cur"))')
        lines.append("            fi")
        lines.append("            return 0 ;;")
    lines += ["    esac", "}", "complete -o filenames -o bashdefault -F _kvpolicy kvpolicy", ""]
    return "\n".join(lines)


def _zsh(top: list[Flag], verbs: list[Verb]) -> str:
    return "\n".join([
        "#compdef kvpolicy",
        "# zsh completion for kvpolicy: generated by `kvpolicy completion zsh`; the bash script, through zsh's",
        "# bashcompinit (the same verbs, flags and values)",
        "autoload -U +X bashcompinit && bashcompinit",
        _bash(top, verbs),
    ])


def _fish_text(text: str) -> str:
    """``text`` as one fish single-quoted string: backslashes and quotes escaped, at most 80 characters."""
    text = text if len(text) <= 80 else text[:77] + "..."
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish(top: list[Flag], verbs: list[Verb]) -> str:
    lines = ["# fish completion for kvpolicy: generated by `kvpolicy completion fish` from its own parser",
             "complete -c kvpolicy -f"]
    for flag in top:
        longs = [n[2:] for n in flag.names if n.startswith("--")]
        for n in longs:
            lines.append(f"complete -c kvpolicy -n '__fish_use_subcommand' -l {n} -d {_fish_text(flag.help)}")
    for verb in verbs:
        for name in verb.names:
            lines.append(f"complete -c kvpolicy -n '__fish_use_subcommand' -a {name} -d {_fish_text(verb.help)}")
        seen = f"__fish_seen_subcommand_from {' '.join(verb.names)}"
        if verb.positional_files:
            lines.append(f"complete -c kvpolicy -n '{seen}' -F")
        for flag in verb.flags:
            parts = [f"-l {n[2:]}" if n.startswith("--") else f"-s {n[1:]}" for n in flag.names if _WORD.match(n)]
            spec = " ".join(parts)
            if flag.values:
                spec += f" -x -a '{_words(flag.values)}'"
            elif flag.files == "dir":
                spec += " -x -a '(__fish_complete_directories)'"
            elif flag.files == "file":
                spec += " -r -F"
            elif flag.takes_value:
                spec += " -x"
            lines.append(f"complete -c kvpolicy -n '{seen}' {spec} -d {_fish_text(flag.help)}")
    return "\n".join(lines) + "\n"


def completion_script(shell: str, parser: argparse.ArgumentParser) -> str:
    """The completion script for ``shell`` (one of `SHELLS`), from ``parser`` (`main.build_parser`'s)."""
    top, verbs = verbs_of(parser)
    return {"bash": _bash, "zsh": _zsh, "fish": _fish}[shell](top, verbs)


def register(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "completion", help="print a shell completion script (bash, zsh, fish) for kvpolicy's verbs and flags",
        description="Print a completion script for SHELL, generated from kvpolicy's own command-line parser: "
                    "verbs, flags and the values of flags with a closed set.",
        epilog=_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash, zsh or fish")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(completion_script(args.shell, args.cli_parser), end="")
    return EXIT_OK
