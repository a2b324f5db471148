"""The argument parser of every zmqps command: a mistake is one line, exit code 2, and
names the closest valid option or value ("did you mean --workers?").

``zmqps``, its subcommands, ``zmqps-server``, ``zmqps-worker`` and ``zmqps bench
scale-sim`` all parse with :class:`Parser`, so every command suggests the same way
(:func:`zmqps.wire.errors.did_you_mean`, which the checks of values after parsing use
too: roles, benchmark suites).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from zmqps.wire.errors import did_you_mean

__all__ = ["Parser"]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (and where to look), not the whole
    usage block ahead of it, and which names the closest valid option or choice of a
    mistyped one. Subcommands' parsers are of this class too (argparse makes them of
    their parent's), and each refuses its own unknown arguments (naming itself and its
    options, not the program's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._suggest(extras)}")
        return parsed, extras

    def _options(self) -> list[str]:
        """The long options a user may give (hidden ones left out), each action's
        first spelling first."""
        out: list[str] = []
        for action in self._actions:
            if action.help == argparse.SUPPRESS:
                continue
            out += [o for o in action.option_strings if o.startswith("--")]
        return out

    def _suggest(self, extras: Sequence[str]) -> str:
        """``; did you mean ...?`` for the first unknown option that is close to a valid
        one (a subcommand's name given where an option was expected counts too)."""
        options = self._options()
        for word in extras:
            if not word.startswith("-") or word == "-":
                continue
            name = word.split("=", 1)[0]
            # -workers, ---workers: compared as the option they were probably meant as
            key = "--" + name.lstrip("-")
            hint = did_you_mean(key, options)
            if hint:
                return hint
        return ""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is None or value in choices:
            return
        names = [str(c) for c in choices]
        hint = did_you_mean(str(value), names, quote=True) if isinstance(value, str) else ""
        raise argparse.ArgumentError(
            action, f"invalid choice: {value!r} (choose from {', '.join(names)}{hint})"
        )
