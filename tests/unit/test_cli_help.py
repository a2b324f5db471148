"""Every flag of every zmqps program says what it does and what its default is (sans-IO:
the parsers only, nothing runs)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from zmqps.cli.main import _build, _common_args, _server_parser, _worker_parser


def _single(build: object) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False)
    _common_args(p)
    build(p)  # type: ignore[operator]
    return p


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    main = _build()
    yield "zmqps", main
    for action in main._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"zmqps {name}", sub
    yield "zmqps-server", _single(_server_parser)
    yield "zmqps-worker", _single(_worker_parser)


PARSERS = dict(_parsers())


@pytest.mark.parametrize("name", PARSERS)
def test_every_flag_has_help_and_no_abbreviations(name: str) -> None:
    parser = PARSERS[name]
    assert parser.allow_abbrev is False
    missing = [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and a.help != argparse.SUPPRESS and not (a.help or "").strip()
    ]
    assert missing == [], f"{name}: flags without help: {missing}"


@pytest.mark.parametrize(
    ("name", "flag", "default"),
    [
        ("zmqps launch", "--placement", "(default: round_robin)"),
        ("zmqps launch", "--heartbeat-timeout", "(default: 10)"),
        ("zmqps launch", "--keep-checkpoints", "(default: 3)"),
        ("zmqps-server", "--placement", "(default: round_robin)"),
        ("zmqps-server", "--heartbeat-timeout", "(default: 10)"),
        ("zmqps-server", "--keep-checkpoints", "(default: 5)"),
    ],
)
def test_help_states_the_default(name: str, flag: str, default: str) -> None:
    (action,) = [a for a in PARSERS[name]._actions if flag in a.option_strings]
    assert (action.help or "").endswith(default)


@pytest.mark.parametrize(
    "argv",
    [
        ["launch", "--ps", "3", "--workers", "2", "--mode", "sync"],
        ["-v", "bench", "dense", "--sides", "zmqps,raw", "--repeat", "2"],
        ["predict", "--model", "m", "--input", "x.npy"],
        ["inspect", "--json", "ck"],
        ["server", "--role", "ps", "--index", "1", "-v"],
        ["task", "--config", "t.json"],
    ],
)
def test_the_parser_of_one_command_parses_it_as_the_whole_parser(argv: list[str]) -> None:
    """``zmqps CMD`` builds CMD's arguments only (the others' modules are not imported
    at a task's start); what it parses is what the parser of every command parses."""
    from zmqps.cli.main import _command

    command = _command(argv)
    assert command == next(a for a in argv if not a.startswith("-"))
    alone = _build(command)
    subs = next(a for a in alone._actions if isinstance(a, argparse._SubParsersAction))
    others = [n for n, p in subs.choices.items() if n != command and len(p._actions) > 2]
    assert not {"launch", "bench", "predict", "inspect"} & set(others), others
    assert vars(alone.parse_args(argv)) == vars(_build().parse_args(argv))
