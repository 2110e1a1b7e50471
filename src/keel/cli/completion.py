"""`keel completion bash|zsh`: a shell completion script generated from keel's own parser, so that every command,
subcommand and flag it completes is one `keel` takes."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field

from keel.cli.pathargs import SHIPPED, PathArg, completes

SHELLS = ("bash", "zsh")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("completion", help="print a shell completion script (docs/cli.md says how to install it)")
    c.add_argument("shell", choices=SHELLS, help="the shell the script is for")
    c.set_defaults(handler=cmd_completion)


def cmd_completion(args: argparse.Namespace) -> int:
    from keel.cli import parser

    print(completion_script(parser(), args.shell), end="")
    return 0


@dataclass
class Command:
    """One command line prefix (`keel ckpt ls`) and what may follow it. A completion is written PATHS|WORDS:
    PATHS "dir", "file", "key" (a config key, as KEY=) or nothing, and the fixed WORDS."""

    words: str
    subcommands: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)  # option that takes a value -> its completion
    positionals: list[str] = field(default_factory=list)  # each positional's completion, in order
    repeats: bool = False  # the last positional takes several values


def completion_of(action: argparse.Action) -> str:
    if isinstance(action, PathArg):
        paths, words = completes(action.check)
        if paths == "config":  # a config file, or the name of a shipped one
            paths, words = "file", tuple(sorted(p.stem for p in SHIPPED.glob("*.toml")))
        return f"{paths}|{' '.join(words)}"
    if action.choices:
        return "|" + " ".join(str(c) for c in action.choices)
    return "key|" if action.dest == "overrides" else "|"


def commands(p: argparse.ArgumentParser, words: str = "keel") -> list[Command]:
    """`p`'s command and every command under it."""
    command, below = Command(words), []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                command.subcommands.append(name)
                below += commands(subparser, f"{words} {name}")
        elif action.option_strings:
            command.options += action.option_strings
            if action.nargs != 0:
                command.values.update(dict.fromkeys(action.option_strings, completion_of(action)))
        else:
            command.positionals.append(completion_of(action))
            command.repeats = action.nargs in ("+", "*", argparse.REMAINDER)
    return [command, *below]


def completion_script(p: argparse.ArgumentParser, shell: str) -> str:
    from keel.config import reference

    every = commands(p)
    keys = [key for key, *_ in reference() if "[" not in key and ".NAME." not in key]
    tables = TABLES.format(
        subcommands=_arms((c.words, " ".join(c.subcommands)) for c in every if c.subcommands),
        options=_arms((c.words, " ".join(c.options)) for c in every),
        values=_arms((f"{c.words} {option}", spec) for c in every for option, spec in c.values.items()),
        positionals=_arms(_positional_arms(every)),
        keys=shlex.quote(" ".join(keys)))
    return (BASH if shell == "bash" else ZSH).replace("@TABLES@", tables)


def _positional_arms(every: list[Command]) -> list[tuple[str, str]]:
    """`COMMAND N` (the Nth positional, from 0) -> its completion; a repeated last one matches any later N."""
    arms = []
    for c in every:
        if c.subcommands:
            continue
        last = len(c.positionals) - 1
        for n, spec in enumerate(c.positionals):
            arms.append((f"{c.words} {'*' if c.repeats and n == last else n}", spec))
    return arms


def _arms(pairs: Iterable[tuple[str, str]]) -> str:
    """Arms of a shell `case`, the pattern quoted except a trailing `*`."""
    lines = []
    for pattern, value in pairs:
        glob = pattern.endswith(" *")
        quoted = shlex.quote(f"{pattern[:-1]}" if glob else pattern) + ("*" if glob else "")
        lines.append(f"        {quoted}) echo {shlex.quote(value)} ;;")
    return "\n".join(lines)


# The tables both shells read: plain functions of POSIX shell syntax.
TABLES = """\
_keel_subcommands() {{
    case "$1" in
{subcommands}
    esac
}}
_keel_options() {{
    case "$1" in
{options}
    esac
}}
# An option that takes a value -> what completes it (PATHS|WORDS); a flag prints nothing.
_keel_value() {{
    case "$1" in
{values}
    esac
}}
_keel_positional() {{
    case "$1" in
{positionals}
    esac
}}
_keel_keys() {{
    echo {keys}
}}"""

BASH = """\
# bash completion for keel, generated from its parser by `keel completion bash`.
# Install: eval "$(keel completion bash)" in ~/.bashrc (see docs/cli.md).
@TABLES@
_keel_complete() {
    local IFS=$'\\n' paths="${1%%|*}" choices="${1#*|}"
    COMPREPLY=($(IFS=' ' compgen -W "$choices" -- "$2"))
    case "$paths" in
        dir) compopt -o filenames 2>/dev/null; COMPREPLY+=($(compgen -d -- "$2")) ;;
        file) compopt -o filenames 2>/dev/null; COMPREPLY+=($(compgen -f -- "$2")) ;;
        key) compopt -o nospace 2>/dev/null; COMPREPLY+=($(IFS=' ' compgen -S = -W "$(_keel_keys)" -- "$2")) ;;
    esac
}
_keel() {
    local cur="${COMP_WORDS[COMP_CWORD]}" cmd=keel spec="" n=0 i w
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${COMP_WORDS[i]}"
        if [[ "$w" == "=" ]]; then  # bash splits --option=VALUE and KEY=VALUE at the =: skip the VALUE
            if ((i + 1 == COMP_CWORD)); then break; fi
            spec=""; i=$((i + 1)); continue
        fi
        if [[ -n "$spec" ]]; then spec=""; continue; fi  # the value of the option before it
        if [[ "$w" == -* ]]; then spec="$(_keel_value "$cmd $w")"; continue; fi
        if [[ " $(_keel_subcommands "$cmd") " == *" $w "* ]]; then cmd="$cmd $w"; continue; fi
        if [[ "${COMP_WORDS[i+1]}" != "=" ]]; then n=$((n + 1)); fi
    done
    if [[ -n "$spec" ]]; then _keel_complete "$spec" "$cur"; return; fi
    if [[ "${COMP_WORDS[COMP_CWORD-1]}" == "=" ]]; then COMPREPLY=(); return; fi  # a KEY=VALUE's value
    if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W "$(_keel_options "$cmd")" -- "$cur")); return; fi
    local subcommands
    subcommands="$(_keel_subcommands "$cmd")"
    if [[ -n "$subcommands" ]]; then COMPREPLY=($(compgen -W "$subcommands" -- "$cur")); return; fi
    _keel_complete "$(_keel_positional "$cmd $n")" "$cur"
}
complete -F _keel keel
"""

ZSH = """\
#compdef keel
# zsh completion for keel, generated from its parser by `keel completion zsh`.
# Install: keel completion zsh > ~/.zfunc/_keel with ~/.zfunc in fpath (see docs/cli.md).
@TABLES@
_keel_complete() {
    local paths=${1%%|*} choices=${1#*|}
    [[ -n $choices ]] && compadd -- ${=choices}
    case $paths in
        dir) _files -/ ;;
        file) _files ;;
        key) compadd -S = -- ${=$(_keel_keys)} ;;
    esac
}
_keel() {
    local cur=${words[CURRENT]} cmd=keel spec="" n=0 i w subcommands
    for ((i = 2; i < CURRENT; i++)); do
        w=${words[i]}
        if [[ -n $spec ]]; then spec=""; continue; fi  # the value of the option before it
        if [[ $w == -*=* ]]; then continue; fi
        if [[ $w == -* ]]; then spec=$(_keel_value "$cmd $w"); continue; fi
        if [[ " $(_keel_subcommands "$cmd") " == *" $w "* ]]; then cmd="$cmd $w"; continue; fi
        n=$((n + 1))
    done
    if [[ -n $spec ]]; then _keel_complete "$spec"; return; fi
    if [[ $cur == -*=* ]]; then
        spec=$(_keel_value "$cmd ${cur%%=*}")
        compset -P '*='
        _keel_complete "$spec"
        return
    fi
    if [[ $cur == *=* ]]; then return; fi  # a KEY=VALUE's value
    if [[ $cur == -* ]]; then compadd -- ${=$(_keel_options "$cmd")}; return; fi
    subcommands=$(_keel_subcommands "$cmd")
    if [[ -n $subcommands ]]; then compadd -- ${=subcommands}; return; fi
    _keel_complete "$(_keel_positional "$cmd $n")"
}
if [[ ${funcstack[1]} == _keel ]]; then
    _keel "$@"  # autoloaded from fpath: the file is _keel's body
else
    compdef _keel keel
fi
"""
