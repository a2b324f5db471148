"""A mistyped flag, subcommand or choice of any zmqps command is one line and exit code
2 that names the closest valid one ("did you mean --workers?") (sans-IO: the parsers
only, nothing runs)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from zmqps.cli.main import _build, _common_args, _server_parser, _worker_parser, main
from zmqps.cli.parser import Parser
from zmqps.config import TaskSpec
from zmqps.wire.errors import ConfigError, closest, did_you_mean


def _single(prog: str, build: object) -> Parser:
    p = Parser(prog=prog, allow_abbrev=False)
    _common_args(p)
    build(p)  # type: ignore[operator]
    return p


def _commands() -> Iterator[tuple[str, list[str], argparse.ArgumentParser]]:
    """(name, the arguments it needs before a flag, its parser) of every command."""
    top = _build()
    yield "zmqps", [], top
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        needed = [name]
        for action in sub._actions:
            if not action.option_strings and action.dest != "help":
                needed.append("x")  # a positional (top's targets, keygen's DIR, ...)
            elif action.required:
                needed += [action.option_strings[0], "x"]
        for group in sub._mutually_exclusive_groups:
            if group.required:  # one of them (status: --chief or --run-dir)
                needed += [group._group_actions[0].option_strings[0], "x"]
        yield f"zmqps {name}", needed, sub
    yield "zmqps-server", [], _single("zmqps-server", _server_parser)
    yield "zmqps-worker", [], _single("zmqps-worker", _worker_parser)


COMMANDS = {name: (needed, parser) for name, needed, parser in _commands()}


def _parse(name: str, argv: list[str]) -> argparse.Namespace:
    if name.startswith("zmqps "):
        return _build().parse_args(argv)
    return COMMANDS[name][1].parse_args(argv)


def _typo(flag: str) -> str:
    """``flag`` with two letters of its name swapped (--workers: --wokrers)."""
    body = flag[2:]
    i = max(0, len(body) // 2 - 1)
    return "--" + body[:i] + body[i + 1] + body[i] + body[i + 2 :]


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    known = set(parser._option_string_actions)
    out = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        for flag in action.option_strings:
            if flag.startswith("--") and len(flag) > 4 and _typo(flag) not in known:
                out.append(flag)
    return out


CASES = [(name, flag) for name, (_, parser) in COMMANDS.items() for flag in _flags(parser)]


@pytest.mark.parametrize(("name", "flag"), CASES, ids=[f"{n}:{f}" for n, f in CASES])
def test_every_mistyped_flag_of_every_command_names_the_flag(
    name: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    needed = COMMANDS[name][0]
    typo = _typo(flag)
    # the program's own flags go before a subcommand; the others' with a value after
    argv, given = ([typo, "cluster"], typo) if name == "zmqps" else ([typo, "1"], f"{typo} 1")
    with pytest.raises(SystemExit) as exc:
        _parse(name, [*needed, *argv])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    prog = name  # the subcommand's own parser refuses it (not the program's)
    assert line.startswith(f"{prog}: error: unrecognized arguments: {given}; did you mean "), line
    assert line.endswith(f"? (see {prog} -h)"), line
    suggested = line.split("; did you mean ")[1].split("?")[0].split(" or ")
    assert flag in suggested or set(suggested) & set(_spellings(COMMANDS[name][1], flag)), line


def _spellings(parser: argparse.ArgumentParser, flag: str) -> list[str]:
    """Every spelling of ``flag``'s action (--ps-hosts, --ps_hosts)."""
    return list(parser._option_string_actions[flag].option_strings)


def _choice_typo(choice: str) -> str:
    return choice[0] + choice[2] + choice[1] + choice[3:]  # mlp: mpl


def _choices() -> Iterator[tuple[str, str, str]]:
    for name, (_, parser) in COMMANDS.items():
        for action in parser._actions:
            if action.option_strings and action.choices and action.help != argparse.SUPPRESS:
                for choice in action.choices:
                    typo = _choice_typo(choice) if isinstance(choice, str) else ""
                    if len(choice) >= 3 and typo and typo not in action.choices:
                        yield name, action.option_strings[0], choice


CHOICES = list(_choices())


@pytest.mark.parametrize(
    ("name", "flag", "choice"), CHOICES, ids=[f"{n}:{f}:{c}" for n, f, c in CHOICES]
)
def test_a_mistyped_choice_names_the_choice(
    name: str, flag: str, choice: str, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = _choice_typo(choice)
    needed = COMMANDS[name][0]
    with pytest.raises(SystemExit) as exc:
        _parse(name, [*needed, flag, typo])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"argument {flag}: invalid choice: {typo!r} (choose from " in line, line
    assert f"did you mean {choice!r}" in line or f"or {choice!r}" in line, line


def test_the_examples_users_hit(capsys: pytest.CaptureFixture[str]) -> None:
    """The newcomer's mistakes, as whole lines."""
    cases = {
        ("launch", "--wokers", "2"): "zmqps launch: error: unrecognized arguments: --wokers 2;"
        " did you mean --workers? (see zmqps launch -h)",
        ("lanch",): "zmqps: error: argument COMMAND: invalid choice: 'lanch' (choose from"
        " launch, server, worker, top, inspect, status, cluster, scale, keygen, task,"
        " predict, bench; did you mean 'launch'?) (see zmqps -h)",
        ("launch", "--model", "mpl"): "zmqps launch: error: argument --model: invalid choice:"
        " 'mpl' (choose from softmax, mlp, ctr, none; did you mean 'mlp'?)"
        " (see zmqps launch -h)",
        ("top", "x", "--intervl", "2"): "zmqps top: error: unrecognized arguments: --intervl 2;"
        " did you mean --interval? (see zmqps top -h)",
        # nothing alike: no suggestion, the same one line
        ("launch", "--zzzzzz"): "zmqps launch: error: unrecognized arguments: --zzzzzz"
        " (see zmqps launch -h)",
    }
    for argv, want in cases.items():
        with pytest.raises(SystemExit) as exc:
            main(list(argv))
        assert exc.value.code == 2
        assert capsys.readouterr().err.splitlines() == [want]


def test_scale_sim_parses_like_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "scale-sim", "--wokers", "10"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "zmqps bench scale-sim: error: unrecognized arguments: --wokers 10; did you mean"
        " --workers? (see zmqps bench scale-sim -h)"
    ]
    with pytest.raises(SystemExit):  # and no prefix matching: --step is not --steps
        main(["bench", "scale-sim", "--step", "3"])
    assert "did you mean --steps?" in capsys.readouterr().err


def test_a_mistyped_role_names_the_role() -> None:
    with pytest.raises(ConfigError) as exc:
        TaskSpec("cheif", 0, source="--role")
    assert str(exc.value) == (
        "--role: unknown task type 'cheif' (expected chief, master, ps, worker or evaluator;"
        " did you mean 'chief'?)"
    )
    with pytest.raises(ConfigError) as exc:
        TaskSpec("trainer", 0, source="--role")
    assert "did you mean" not in str(exc.value)


def test_a_mistyped_bench_suite_names_the_suite(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "dens"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("zmqps: error: unknown suite 'dens' (expected dense, ")
    assert line.endswith("; did you mean 'dense'?)")


def test_closest_is_the_best_and_those_about_as_close() -> None:
    options = ["--workers", "--no-metrics", "--gpus-per-worker", "--worker-hosts"]
    assert closest("--wokers", options) == ["--workers"]
    assert closest("snyc", ["async", "sync", "ssp"]) == ["sync", "async"]
    assert closest("--zzz", options) == []
    assert closest("MLP", ["mlp", "softmax"]) == ["mlp"]  # case does not matter
    assert did_you_mean("--zzz", options) == ""
    assert did_you_mean("mpl", ["mlp"], quote=True) == "; did you mean 'mlp'?"


def test_a_mistyped_job_of_a_cluster_spec_names_the_job() -> None:
    from zmqps.config import parse_tf_config

    spec = '{"cluster": {"chief": ["127.0.0.1:1"], "wokers": ["127.0.0.1:3"]}}'
    with pytest.raises(ConfigError) as exc:
        parse_tf_config(spec)
    assert str(exc.value).endswith(
        "unknown job 'wokers' in cluster (expected chief, master, ps, worker or evaluator;"
        " did you mean 'worker'?)"
    )
