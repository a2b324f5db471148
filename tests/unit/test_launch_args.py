"""Flags that ``zmqps launch`` and ``zmqps-server`` share are checked by the same code,
with the same one-line messages, before anything starts (sans-IO but for the folder
checks: the parsers and the checks only, nothing runs)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from zmqps.cli.args import check_output_dir
from zmqps.cli.launch import (
    CHECKPOINT_SECS,
    Launcher,
    check_launch_args,
    hold_folders,
    release_folders,
)
from zmqps.cli.main import _build, _common_args, _server_parser, main
from zmqps.cli.tasks import task_from_args
from zmqps.config import ClusterSpec, TaskSpec
from zmqps.roles.configs import CheckpointPolicy, ChiefConfig
from zmqps.wire.errors import EXIT_CONFIG, ConfigError, ZmqpsError

CLUSTER = ClusterSpec(chief="127.0.0.1:1", ps=("127.0.0.1:2",), worker=("127.0.0.1:3",))


def launch_args(*flags: str) -> argparse.Namespace:
    return _build().parse_args(["launch", *flags])


def server_args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    _common_args(p)
    _server_parser(p)
    return p.parse_args(["--model", "mlp", *flags])


def chief_of(*flags: str) -> ChiefConfig:
    chief = task_from_args(server_args(*flags), CLUSTER, TaskSpec("chief", 0)).chief
    assert chief is not None
    return chief


#: flags both commands have, a bad value, and the message both give (a duration that
#: is negative, nan or infinite is refused by its flag's type: test_seconds_flags.py)
SHARED = {
    "zero-checkpoint-secs": (["--checkpoint-secs", "0"], "--checkpoint-secs must be > 0, got 0"),
    "zero-checkpoint-steps": (
        ["--checkpoint-steps", "0"],
        "--checkpoint-steps must be >= 1, got 0",
    ),
    "negative-checkpoint-steps": (
        ["--checkpoint-steps", "-3"],
        "--checkpoint-steps must be >= 1, got -3",
    ),
    "zero-keep-checkpoints": (
        ["--keep-checkpoints", "0"],
        "--keep-checkpoints must be >= 1, got 0",
    ),
    "zero-num-shards": (["--num-shards", "0"], "--num-shards must be >= 1, got 0"),
    "staleness-without-ssp": (
        ["--max-staleness", "3"],
        "--max-staleness applies only to --mode ssp (this run is async)",
    ),
    # a typo, not two layers (it was read as 128,64)
    "hidden-empty-size": (
        ["--hidden", "128,,64"],
        "--hidden '128,,64': expected sizes like 128 or 256,128",
    ),
    "hidden-trailing-comma": (
        ["--hidden", "128,"],
        "--hidden '128,': expected sizes like 128 or 256,128",
    ),
    "hidden-zero": (["--hidden", "128,0"], "--hidden '128,0': sizes must be positive"),
    # a size mistyped by a few digits: the task ran out of memory
    "hidden-too-big": (
        ["--hidden", "5000000"],
        "--hidden 5000000 on digits: about 370 million weights (1.4 GiB of float32 on the"
        " PS and on each worker); the built-in MLP takes at most 268 million",
    ),
    "staleness-in-sync": (
        ["--mode", "sync", "--max-staleness", "0"],
        "--max-staleness applies only to --mode ssp (this run is sync)",
    ),
}

HUNG = (
    " (the launcher asks the chief's status twice a second: a shorter bound kills a healthy"
    " chief between two of its answers)"
)

#: launch only
LAUNCH = {
    "zero-hung-after": (["--hung-after", "0"], f"--hung-after must be at least 2 s, got 0{HUNG}"),
    # killed a healthy chief between two status answers, mid-run
    "half-second-hung-after": (
        ["--hung-after", "0.5"],
        f"--hung-after must be at least 2 s, got 0.5{HUNG}",
    ),
    # every live worker counted dead between two of its heartbeats
    "heartbeat-timeout-below-two-heartbeats": (
        ["--heartbeat-timeout", "1"],
        "--heartbeat-timeout must be at least 2 s, got 1 (workers send a heartbeat each"
        " second: a shorter timeout counts live workers dead)",
    ),
    "intervals-without-checkpoints": (
        ["--no-checkpoints", "--checkpoint-steps", "5"],
        "--checkpoint-steps / --checkpoint-secs need checkpoints (they were turned off by"
        " --no-checkpoints)",
    ),
}


@pytest.mark.parametrize("case", sorted({**SHARED, **LAUNCH}))
def test_launch_refuses_a_bad_value_before_anything_starts(case: str) -> None:
    flags, message = {**SHARED, **LAUNCH}[case]
    with pytest.raises(ConfigError) as err:
        check_launch_args(launch_args(*flags))
    assert str(err.value) == message


def test_the_command_exits_2_with_one_line_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def started(*args: object) -> None:
        raise AssertionError("the launcher was started")

    monkeypatch.setattr("zmqps.cli.launch.Launcher", started)
    run = tmp_path / "run"
    argv = ["launch", "--run-dir", str(run), "--no-progress", "--num-shards", "0"]
    assert main(argv) == EXIT_CONFIG
    assert capsys.readouterr().err == "zmqps: error: --num-shards must be >= 1, got 0\n"
    assert not run.exists()


@pytest.mark.parametrize("case", sorted(SHARED))
def test_the_server_refuses_the_same_values_with_the_same_message(case: str) -> None:
    flags, message = SHARED[case]
    checkpointed = ["--checkpoint-dir", "/nonexistent/ckpt"] if "checkpoint" in case else []
    with pytest.raises(ConfigError) as err:
        chief_of(*checkpointed, *flags)
    assert str(err.value) == message


def test_the_server_refuses_intervals_without_a_checkpoint_dir() -> None:
    with pytest.raises(ConfigError, match=r"^--checkpoint-steps / --checkpoint-secs need"):
        chief_of("--checkpoint-secs", "30")


def test_the_defaults_are_unchanged(tmp_path: Path) -> None:
    """No interval given: by time (launch every 5 s, the server every 600 s); steps
    given: by steps only; --max-staleness 2 in ssp."""
    check_launch_args(launch_args())
    check_launch_args(launch_args("--mode", "ssp", "--max-staleness", "0", "--timeout", "9"))
    server = chief_of("--checkpoint-dir", "/ckpt", "--mode", "ssp")
    assert server.checkpoint == CheckpointPolicy("/ckpt", 0, 600.0, 5)
    assert server.sync.max_staleness == 2
    steps = chief_of("--checkpoint-dir", "/c", "--checkpoint-steps", "7")
    assert steps.checkpoint == CheckpointPolicy("/c", 7, 0.0, 5)
    assert chief_of().checkpoint is None

    def launched(*flags: str) -> CheckpointPolicy | None:
        args = launch_args("--ps", "1", "--workers", "1", "--no-metrics", *flags)
        check_launch_args(args)
        (name, task), *_ = Launcher(args, tmp_path).task_configs(None)
        assert name == "chief" and task.chief is not None
        return task.chief.checkpoint

    root = str((tmp_path / "checkpoints").resolve())
    assert launched() == CheckpointPolicy(root, 0, CHECKPOINT_SECS, 3)
    assert CHECKPOINT_SECS == 5.0
    assert launched("--checkpoint-steps", "4", "--keep-checkpoints", "1") == CheckpointPolicy(
        root, 4, 0.0, 1
    )
    assert launched("--no-checkpoints") is None


def test_help_says_what_values_are_taken() -> None:
    parser = next(
        sub
        for a in _build()._actions
        if isinstance(a, argparse._SubParsersAction)
        for name, sub in a.choices.items()
        if name == "launch"
    )
    helps = {a.option_strings[0]: a.help or "" for a in parser._actions if a.option_strings}
    assert "S > 0" in helps["--checkpoint-secs"]
    assert "N >= 1" in helps["--checkpoint-steps"]
    assert "--no-checkpoints" in helps["--checkpoint-steps"]
    assert "K >= 1" in helps["--keep-checkpoints"]
    assert "S > 0" in helps["--timeout"]
    assert "only with --mode ssp" in helps["--max-staleness"]


# --- folders the tasks write in -----------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "dest"),
    [("--checkpoint-dir", "checkpoint_dir"), ("--export-dir", "export_dir"), ("--logdir", "")],
)
def test_a_folder_under_a_file_is_refused_up_front(tmp_path: Path, flag: str, dest: str) -> None:
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "sub"
    with pytest.raises(ConfigError) as err:
        check_launch_args(launch_args(flag, str(bad)))
    assert str(err.value) == f"{flag} {bad}: cannot create it (Not a directory)"


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model").write_text("")
    with pytest.raises(ConfigError) as err:
        check_launch_args(launch_args("--export-dir", str(tmp_path / "model")))
    assert str(err.value) == (
        f"--export-dir {tmp_path / 'model'}: cannot create it (a file of that name is in the way)"
    )


def test_a_checkpoint_dir_of_a_run_without_checkpoints_is_not_looked_at(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    check_launch_args(launch_args("--no-checkpoints", "--checkpoint-dir", str(tmp_path / "file")))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_a_read_only_folder_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError) as err:
            check_launch_args(launch_args("--logdir", str(ro / "tb")))
        assert str(err.value) == f"--logdir {ro / 'tb'}: cannot create it (Permission denied)"
        with pytest.raises(ConfigError) as err:
            check_output_dir("--export-dir", ro)
        assert str(err.value) == f"--export-dir {ro}: cannot write in it (Permission denied)"
    finally:
        ro.chmod(0o755)


def test_a_summary_path_that_cannot_be_a_file_is_refused_before_the_run(tmp_path: Path) -> None:
    """``--summary <a folder>`` trained the whole run, then failed at its last line
    with a raw errno."""
    for argv, message in [
        ((str(tmp_path),), f"--summary {tmp_path}: that is a folder (name the file to write)"),
        (
            (str(tmp_path / "f" / "s.json"),),
            f"--summary {tmp_path / 'f'}: cannot create it (a file of that name is in the way)",
        ),
    ]:
        (tmp_path / "f").write_text("")
        with pytest.raises(ConfigError) as err:
            check_launch_args(launch_args("--summary", *argv))
        assert str(err.value) == message
    (tmp_path / "f").unlink()
    check_launch_args(launch_args("--summary", str(tmp_path / "s.json")))
    check_launch_args(launch_args("--summary", str(tmp_path / "new" / "s.json")))  # made later
    assert list(tmp_path.iterdir()) == []  # nothing written to find out


def test_prometheus_targets_are_checked_before_the_run_as_the_summary_is(tmp_path: Path) -> None:
    """``--prometheus-targets <a folder>`` started the run, then failed with a raw
    errno (exit 1); with ``--no-metrics`` it wrote nothing and said nothing."""
    cases = [
        (("--prometheus-targets", str(tmp_path)), "that is a folder (name the file to write)"),
        (("--no-metrics", "--prometheus-targets", str(tmp_path / "t.json")), "--no-metrics"),
    ]
    for argv, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_launch_args(launch_args(*argv))
    check_launch_args(launch_args("--prometheus-targets", str(tmp_path / "t.json")))
    assert list(tmp_path.iterdir()) == []


def test_the_check_leaves_nothing_behind(tmp_path: Path) -> None:
    """A folder that appeared would look like an earlier run's (resume_from)."""
    deep = tmp_path / "a" / "b" / "c"
    check_launch_args(launch_args("--logdir", str(deep), "--export-dir", str(tmp_path / "m")))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    check_output_dir("--checkpoint-dir", tmp_path / "kept")
    assert (tmp_path / "kept").is_dir()


def test_resume_refuses_another_split_of_the_data_and_takes_more_epochs_or_ps() -> None:
    """--resume with another --workers was taken without a word: each worker's batch
    cursor then pointed into another part of the data (batches trained twice or
    never). The split, batch size, dataset and seed must be the checkpoint's run's."""
    from types import SimpleNamespace

    from zmqps.cli.launch import _check_same_data

    data = {"workers": 2, "dataset": "digits", "batch_size": 32, "seed": 0}
    ckpt = SimpleNamespace(name="ckpt-000000000092", manifest=SimpleNamespace(extra={"data": data}))
    _check_same_data(launch_args("--workers", "2", "--epochs", "9", "--ps", "3"), ckpt)  # type: ignore[arg-type]
    for flags, flag in (
        (("--workers", "3"), "--workers 2"),
        (("--batch-size", "64"), "--batch-size 32"),
        (("--seed", "7"), "--seed 0"),
    ):
        with pytest.raises(ConfigError, match=f"trained with {flag}, this run has"):
            _check_same_data(launch_args(*flags), ckpt)  # type: ignore[arg-type]
    ctr = {"workers": 2, "dataset": "synthetic-ctr", "batch_size": 256, "seed": 0}
    ckpt = SimpleNamespace(
        name="c", manifest=SimpleNamespace(extra={"data": {**ctr, "examples": 20000}})
    )
    ctr_args = ("--model", "ctr", "--dataset", "synthetic-ctr", "--batch-size", "256")
    _check_same_data(launch_args(*ctr_args, "--examples", "20000"), ckpt)  # type: ignore[arg-type]
    for flags, flag in ((("--examples", "4000"), "--examples 20000"),):
        with pytest.raises(ConfigError, match=f"trained with {flag}, this run has"):
            _check_same_data(launch_args(*ctr_args, *flags), ckpt)  # type: ignore[arg-type]
    bf16 = SimpleNamespace(name="c", manifest=SimpleNamespace(extra={"wire_dtype": "bfloat16"}))
    _check_same_data(launch_args("--wire-dtype", "bfloat16"), bf16)  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match="trained with --wire-dtype bfloat16, this run has float32"
    ):
        _check_same_data(launch_args(), bf16)  # type: ignore[arg-type]
    old = SimpleNamespace(name="ckpt-1", manifest=SimpleNamespace(extra={}))
    _check_same_data(launch_args("--workers", "5"), old)  # type: ignore[arg-type]


def test_resume_refuses_another_model_before_anything_starts() -> None:
    """--resume with another --model (or --hidden, --optimizer, --lr, --momentum)
    started the cluster, restored it, and only then did the chief refuse the model
    (exit 2, 13-17 s in; the README said another learning rate was fine, but the PS
    hold the optimizer with the variables). The checkpoint records the model and its
    optimizer: refused up front, naming both."""
    from types import SimpleNamespace

    from zmqps.cli.launch import _check_same_data

    opt = {"lr": 0.05, "momentum": 0.9, "name": "momentum"}
    model = {"model": "mlp", "hidden": [128], "optimizer": opt}
    ckpt = SimpleNamespace(name="ckpt-46", manifest=SimpleNamespace(extra={"model": model}))
    _check_same_data(launch_args("--epochs", "9", "--ps", "3"), ckpt)  # type: ignore[arg-type]
    flags = "(--optimizer momentum --lr 0.05 --momentum 0.9)"
    was = f"--model mlp --hidden 128 {flags}"
    for flags_given, now in (
        (("--model", "softmax"), f"--model softmax {flags}"),
        (("--hidden", "64"), f"--model mlp --hidden 64 {flags}"),
        (("--optimizer", "adam"), "--model mlp --hidden 128 (--optimizer adam --lr 0.001)"),
        (("--lr", "0.01"), f"--model mlp --hidden 128 {flags.replace('0.05', '0.01')}"),
        (("--momentum", "0.5"), f"--model mlp --hidden 128 {flags.replace('0.9', '0.5')}"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            _check_same_data(launch_args(*flags_given), ckpt)  # type: ignore[arg-type]
        assert str(err.value) == (
            f"--resume: ckpt-46 was trained with {was}, this run has {now}: a checkpoint holds"
            " one model's variables; resume with its flags, or start a new --run-dir"
        )
    # a checkpoint that recorded the optimizer's name alone: compared on the name
    named = {"model": "mlp", "hidden": [128], "optimizer": "momentum"}
    old = SimpleNamespace(name="ckpt-7", manifest=SimpleNamespace(extra={"model": named}))
    _check_same_data(launch_args("--lr", "0.01"), old)  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"trained with --model mlp --hidden 128 \(--optimizer momentum\)"
    ):
        _check_same_data(launch_args("--optimizer", "sgd"), old)  # type: ignore[arg-type]


def test_hung_after_is_three_heartbeat_timeouts_at_least_15_s_unless_given(
    tmp_path: Path,
) -> None:
    """How long a task may run while the chief counts it dead before the launcher
    kills it (to be restarted)."""
    assert Launcher(launch_args(), tmp_path).hung_after() == 30.0  # 3 x 10 s
    assert Launcher(launch_args("--heartbeat-timeout", "2"), tmp_path).hung_after() == 15.0
    assert Launcher(launch_args("--hung-after", "4.5"), tmp_path).hung_after() == 4.5


def test_the_folders_a_launch_holds_are_gone_again_when_it_does_not_start(
    tmp_path: Path,
) -> None:
    """The run folder and its default checkpoint folder are made and locked; a launch
    that does not start removes both again, the deeper first (the run folder was
    left behind, holding an empty checkpoint folder)."""
    run = tmp_path / "a" / "run"
    fds, made = hold_folders(launch_args("--run-dir", str(run)))
    assert (run / "checkpoints").is_dir() and len(fds) == 2
    release_folders(fds, made)
    assert list(tmp_path.iterdir()) == []


def test_a_default_checkpoint_folder_in_use_is_named_as_the_run_dirs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    other = launch_args(
        "--run-dir", str(tmp_path / "other"), "--checkpoint-dir", str(run / "checkpoints")
    )
    fds, made = hold_folders(other)  # another launch names this one's default folder
    try:
        with pytest.raises(ZmqpsError) as refused:
            hold_folders(launch_args("--run-dir", str(run)))
        assert str(refused.value) == (
            f"--run-dir {run}'s checkpoint folder {run / 'checkpoints'} is in use by another"
            " zmqps launch (or its tasks, still exiting): wait for it to end, or choose"
            " another folder"
        )
    finally:
        release_folders(fds, made)
    assert list(tmp_path.iterdir()) == []


def test_a_chief_that_shut_its_ps_down_is_not_started_again(tmp_path: Path) -> None:
    """A chief that failed after it shut the PS down (its summary could not be written,
    say) is not started again: it would wait minutes for PS that are gone. A chief that
    failed with its PS running is, after a short wait for them."""
    import asyncio

    from zmqps.cli.launch import Child

    launcher = Launcher(launch_args("--ps", "2"), tmp_path)
    ps = [c for c in launcher.children if c.name.startswith("ps")]
    assert len(ps) == 2
    for c in ps:
        c.proc = object()  # type: ignore[assignment]  # started
    assert not asyncio.run(launcher._ps_shut_down(wait=0.2))  # running: restart the chief

    async def ending() -> bool:
        # shut down, both exiting a moment after the chief
        asyncio.get_running_loop().call_later(0.1, lambda: setattr(ps[0], "returncode", 0))
        asyncio.get_running_loop().call_later(0.2, lambda: setattr(ps[1], "returncode", 0))
        return await launcher._ps_shut_down(wait=2.0)

    assert asyncio.run(ending())
    ps[1].returncode = 1  # one PS failed: not a shutdown by the chief
    assert not asyncio.run(launcher._ps_shut_down(wait=0.0))
    assert isinstance(launcher.children[0], Child) and launcher.children[0].name == "chief"


def test_the_coordinators_built_in_job_refuses_the_ctr_model_before_the_run() -> None:
    """``--driver coordinator --model ctr``: the built-in drive() failed on the dataset
    two minutes after the cluster started, with only "training has waited" lines
    before. Refused at once; a --job module of one's own may train it."""
    with pytest.raises(ConfigError, match="--model ctr trains with the workers' own loop"):
        check_launch_args(launch_args("--driver", "coordinator", "--model", "ctr"))
    check_launch_args(launch_args("--driver", "coordinator", "--model", "mlp"))
    check_launch_args(launch_args("--driver", "coordinator", "--model", "ctr", "--job", "json"))


def test_resume_without_the_runs_checkpoint_folder_names_the_one_it_used(tmp_path: Path) -> None:
    """``--resume`` on a run that kept its checkpoints in a --checkpoint-dir of its own
    said only "no checkpoint in RUN_DIR/checkpoints"; it names the folder the run's
    chief was given."""
    import json

    from zmqps.cli.launch import resume_from

    run = tmp_path / "run"
    (run / "tasks").mkdir(parents=True)
    task = {"chief": {"checkpoint": {"directory": str(tmp_path / "ck")}}}
    (run / "tasks" / "chief.json").write_text(json.dumps(task))
    args = launch_args("--resume", "--run-dir", str(run))
    with pytest.raises(ConfigError, match=re.escape(f"pass --checkpoint-dir {tmp_path / 'ck'}")):
        resume_from(args, run)


def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A launch stopped before its first checkpoint left a folder that could be neither
    resumed ("no checkpoint to go on from") nor used again ("holds an earlier run"):
    ``--resume`` starts it over, saying so. A folder of no run is refused as before."""
    import json

    from zmqps.cli.launch import resume_from

    run = tmp_path / "run"
    (run / "tasks").mkdir(parents=True)
    task = {"chief": {"checkpoint": {"directory": str(run / "checkpoints")}}}
    (run / "tasks" / "chief.json").write_text(json.dumps(task))
    assert resume_from(launch_args("--resume", "--run-dir", str(run)), run) is None
    said = (
        f"zmqps launch: --resume: no checkpoint in {run / 'checkpoints'} (the run in {run} was"
        " stopped, or failed, before its first): it starts from the beginning\n"
    )
    assert capsys.readouterr().err == said
    # failed before its first (its disk full): the chief's summary says failed, and the
    # folder could be neither resumed nor used again
    (run / "chief-summary.json").write_text(json.dumps({"failed": "no space left on device"}))
    assert resume_from(launch_args("--resume", "--run-dir", str(run)), run) is None
    assert capsys.readouterr().err == said
    # one that ended well with no checkpoint is not started over
    (run / "chief-summary.json").write_text(json.dumps({"global_step": 920}))
    with pytest.raises(ConfigError, match=r"no checkpoint in .* to go on from"):
        resume_from(launch_args("--resume", "--run-dir", str(run)), run)
    (run / "chief-summary.json").unlink()
    with pytest.raises(ConfigError, match="holds an earlier run"):  # without --resume
        resume_from(launch_args("--run-dir", str(run)), run)
    other = tmp_path / "typo"
    with pytest.raises(ConfigError, match=r"no checkpoint in .* to go on from"):
        resume_from(launch_args("--resume", "--run-dir", str(other)), other)


def test_resume_with_every_checkpoint_unreadable_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three checkpoints, all damaged: ``--resume`` said "stopped before its first" and
    started over; it starts over saying that none can be read, naming them."""
    import json

    from zmqps.cli.launch import resume_from

    run = tmp_path / "run"
    (run / "tasks").mkdir(parents=True)
    task = {"chief": {"checkpoint": {"directory": str(run / "checkpoints")}}}
    (run / "tasks" / "chief.json").write_text(json.dumps(task))
    for step in (100, 200, 300):  # each without its manifest
        (run / "checkpoints" / f"ckpt-{step:012d}").mkdir(parents=True)
    assert resume_from(launch_args("--resume", "--run-dir", str(run)), run) is None
    err = capsys.readouterr().err
    assert "before its first" not in err, err
    assert (
        f"--resume: none of the 3 checkpoints in {run / 'checkpoints'} can be read"
        " (ckpt-000000000100, ckpt-000000000200, ckpt-000000000300" in err
    ), err


def test_a_launch_past_the_machines_memory_is_refused_before_it_starts() -> None:
    """``--workers 3000`` on a 2-core machine started processes for 17 minutes. Each
    task is a process of 48 MiB at least: a launch past the memory available is one
    line, exit 2."""
    from zmqps.cli.launch import TASK_BYTES, _check_room

    gib = 1 << 30
    _check_room(5, 16 * gib)
    _check_room(3003, None)  # not known: not judged
    with pytest.raises(ConfigError) as err:
        _check_room(3003, 16 * gib)
    assert str(err.value) == (
        f"3003 tasks (each a process of {TASK_BYTES >> 20} MiB at least) need 140.8 GiB; this"
        " machine has 16.0 GiB available: fewer --workers, or start them on several machines"
        " (zmqps-worker; zmqps bench scale-sim simulates many workers in one process)"
    )


def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path,
) -> None:
    """``--summary /proc/x.json`` passed a check of the folder's modes (root may write
    anywhere by them) and failed only after the whole run had trained. The file is
    tried: created and removed, or opened to append (nothing changed)."""
    from zmqps.cli.args import check_output_file

    with pytest.raises(ConfigError, match=r"--summary /proc/zmqps-x\.json: cannot write it"):
        check_output_file("--summary", "/proc/zmqps-x.json")
    fresh = tmp_path / "s.json"
    check_output_file("--summary", fresh)
    assert not fresh.exists()  # the try left nothing
    kept = tmp_path / "kept.json"
    kept.write_text("{}\n")
    check_output_file("--summary", kept)
    assert kept.read_text() == "{}\n"  # opened to append, not truncated
    with pytest.raises(ConfigError, match="that is a folder"):
        check_output_file("--summary", tmp_path)
