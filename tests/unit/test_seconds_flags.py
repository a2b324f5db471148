"""Every duration flag takes a finite number of seconds >= 0: ``--timeout inf`` made
``zmqps status`` wait for ever, ``--startup-timeout nan`` a chief wait for its PS for
ever, ``--wait -1`` say "not done after -1s"."""

from __future__ import annotations

import pytest

from zmqps.cli.main import main

CHIEF = ["--chief", "127.0.0.1:1"]
HOSTS = [
    "--chief-host",
    "127.0.0.1:1",
    "--ps-hosts",
    "127.0.0.1:2",
    "--worker-hosts",
    "127.0.0.1:3",
]

CASES = {
    "status --timeout": ["status", *CHIEF, "--timeout"],
    "scale --wait": ["scale", *CHIEF, "--ps", "1", "--wait"],
    "top --interval": ["top", "http://127.0.0.1:1/metrics", "--interval"],
    "server --startup-timeout": ["server", *HOSTS, "--role", "chief", "--startup-timeout"],
    "server --heartbeat-timeout": ["server", *HOSTS, "--role", "chief", "--heartbeat-timeout"],
    "worker --connect-timeout": ["worker", *HOSTS, "--index", "0", "--connect-timeout"],
    "launch --timeout": ["launch", "--timeout"],
    "launch --hung-after": ["launch", "--hung-after"],
    "launch --checkpoint-secs": ["launch", "--checkpoint-secs"],
    "launch --stall-timeout": ["launch", "--stall-timeout"],
    "server --checkpoint-secs": ["server", *HOSTS, "--role", "chief", "--checkpoint-secs"],
}


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "soon"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_duration_flag_takes_finite_seconds_only(
    case: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    *argv, flag = CASES[case]
    with pytest.raises(SystemExit) as ended:
        main([*argv, f"{flag}={value}"])  # (-inf alone reads as an option)
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"argument {flag}: {value!r}" in err[0], err


@pytest.mark.parametrize("ps", ["0", "-1", str((1 << 20) + 1), "99999999999999999999"])
def test_a_scale_count_out_of_range_is_one_line_before_anything_is_sent(
    ps: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``zmqps scale --ps 99999999999999999999`` failed in the message's encoding with
    a traceback (exit 1); every count out of range is one line, exit code 2, and no
    chief is asked (none answers at 127.0.0.1:1)."""
    assert main(["scale", *CHIEF, "--ps", ps, "--timeout", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ps must be between 1 and 1048576" in err[0], err


@pytest.mark.parametrize("value", ["0", "-5", "-0.5", "0.0"])
@pytest.mark.parametrize("case", ["status --timeout", "launch --timeout"])
def test_a_timeout_that_must_be_positive_says_so_for_zero_and_negatives_alike(
    case: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``zmqps status --timeout 0`` said "must be > 0" and ``--timeout -5`` "expected
    a finite number of seconds >= 0": what is accepted is > 0, and both say so."""
    *argv, flag = CASES[case]
    with pytest.raises(SystemExit) as ended:
        main([*argv, f"{flag}={value}"])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"argument {flag}: {value!r}: expected a finite number of seconds > 0" in err[0]


def test_a_positive_timeout_is_taken() -> None:
    from zmqps.cli.args import positive_seconds

    assert positive_seconds("0.25") == 0.25 and positive_seconds("5") == 5.0
