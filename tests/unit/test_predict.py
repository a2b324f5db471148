"""``zmqps predict`` in-process: reading inputs and labels, outputs, and user errors (exit 2)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from zmqps.cli.main import main
from zmqps.cli.predict import read_examples, read_labels
from zmqps.data import load_digits
from zmqps.data.preprocessing import preprocessing
from zmqps.export import WEIGHTS_FILE, export_model
from zmqps.models import Model, build_model
from zmqps.wire.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

DIM, CLASSES = 6, 3


@pytest.fixture
def model() -> Model:
    return build_model("softmax", DIM, CLASSES, seed=0)


@pytest.fixture
def params(model: Model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {v.name: rng.normal(size=v.shape).astype(v.dtype) for v in model.variables()}


@pytest.fixture
def export(tmp_path: Path, model: Model, params: dict[str, np.ndarray]) -> Path:
    return export_model(tmp_path / "model", model.signature(), params)


@pytest.fixture
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(25, DIM)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=25)
    return x, y


# -- reading ------------------------------------------------------------------------


def test_csv_with_header_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("a,b,c\n1,2,3\n\n4.5,-5,6e-1\n")
    x, labels = read_examples(path)
    np.testing.assert_array_equal(x, np.array([[1, 2, 3], [4.5, -5, 0.6]], np.float32))
    assert x.dtype == np.float32 and labels is None


def test_csv_without_header_and_a_label_column(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("1,2,0\n3,4,2\n")
    x, labels = read_examples(path, label_column=-1)
    np.testing.assert_array_equal(x, [[1, 2], [3, 4]])
    assert labels is not None and labels.tolist() == [0, 2] and labels.dtype == np.int64
    x, labels = read_examples(path, label_column=0)
    np.testing.assert_array_equal(x, [[2, 0], [4, 2]])
    assert labels is not None and labels.tolist() == [1, 3]


def test_npy_vector_is_one_example(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(4.0))
    x, _ = read_examples(tmp_path / "x.npy")
    assert x.shape == (1, 4)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("x.csv", "1,2\n3\n", "line 2 has 1 columns, the first row has 2"),
        ("x.csv", "1,2\n3,x\n", "line 2 has a value that is not a number"),
        ("x.csv", "a,b\n", "no rows of numbers"),
        ("x.csv", "1,nan\n", "NaN or infinite"),
        ("x.txt", "1,2\n", "expected a .npy or .csv file"),
        ("x.npy", "not npy", "cannot read as .npy"),
    ],
)
def test_bad_inputs(tmp_path: Path, name: str, content: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        read_examples(path)


def test_object_arrays_are_refused_without_unpickling(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ConfigError, match=r"cannot read as \.npy"):
        read_examples(tmp_path / "x.npy")


def test_labels(tmp_path: Path) -> None:
    np.save(tmp_path / "y.npy", np.array([1.0, 2.0]))
    assert read_labels(tmp_path / "y.npy").tolist() == [1, 2]
    (tmp_path / "y.csv").write_text("label\n0\n2\n")
    assert read_labels(tmp_path / "y.csv").tolist() == [0, 2]
    np.save(tmp_path / "bad.npy", np.array([0.5]))
    with pytest.raises(ConfigError, match="whole numbers"):
        read_labels(tmp_path / "bad.npy")
    np.save(tmp_path / "two.npy", np.zeros((2, 2)))
    with pytest.raises(ConfigError, match="one label per example"):
        read_labels(tmp_path / "two.npy")


# -- the command ----------------------------------------------------------------------


def test_classes_to_stdout_and_accuracy_to_stderr(
    tmp_path: Path,
    export: Path,
    model: Model,
    params: dict[str, np.ndarray],
    data: tuple[np.ndarray, np.ndarray],
    capsys: pytest.CaptureFixture[str],
) -> None:
    x, y = data
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    argv = ["predict", "--model", str(export), "--input", str(tmp_path / "x.npy")]
    assert main([*argv, "--labels", str(tmp_path / "y.npy")]) == 0
    out, err = capsys.readouterr()
    assert [int(v) for v in out.split()] == model.predict(params, x).tolist()
    want = model.evaluate(params, x, y)
    correct = int(np.sum(model.predict(params, x) == y))
    assert f"accuracy {want['accuracy']:.6f} ({correct}/25), loss {want['loss']:.6f}" in err


@pytest.mark.parametrize("suffix", [".npy", ".csv"])
def test_probabilities_to_a_file(
    tmp_path: Path,
    export: Path,
    model: Model,
    params: dict[str, np.ndarray],
    data: tuple[np.ndarray, np.ndarray],
    capsys: pytest.CaptureFixture[str],
    suffix: str,
) -> None:
    x, y = data
    np.savetxt(
        tmp_path / "xy.csv", np.column_stack([y, x]), delimiter=",", header="y,f", comments=""
    )
    out_path = tmp_path / f"p{suffix}"
    argv = ["predict", "--model", str(export), "--input", str(tmp_path / "xy.csv")]
    argv += ["--label-column", "0", "--format", "probabilities", "--output", str(out_path)]
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("accuracy ")  # predictions went to the file: the score to stdout
    probs = np.load(out_path) if suffix == ".npy" else np.loadtxt(out_path, delimiter=",")
    assert probs.shape == (25, CLASSES)
    np.testing.assert_allclose(probs, model.predict_proba(params, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--input", "X8"], "8 features per example, the model takes 6"),
        (["--input", "Z6", "--label-column", "0"], "5 features per example, the model takes 6"),
        (["--input", "X6", "--labels", "Y3"], "3 labels for 25 examples"),
        (["--input", "X6", "--labels", "Ybig"], "labels must lie in 0..2"),
        (["--input", "X6", "--labels", "Y3", "--label-column", "1"], "not both"),
        (["--input", "X6", "--output", "out.txt"], "expected a .npy or .csv file"),
        (["--input", "missing.npy"], "cannot read as .npy"),
        (["--input", "X6", "--output", "nowhere/p.csv"], "folder"),
        (["--input", "X6", "--output", "X6.npy/p.npy"], "X6.npy is not a folder"),
        (["--input", "X6", "--output", "adir.npy"], "is a folder"),
    ],
)
def test_user_errors_exit_2(
    tmp_path: Path,
    export: Path,
    data: tuple[np.ndarray, np.ndarray],
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    x, y = data
    files = {
        "X8": np.zeros((25, 8), np.float32),
        "X6": x,
        "Z6": np.zeros((25, 6)),
        "Y3": y[:3],
        "Ybig": np.full(25, 3),
    }
    for name, a in files.items():
        np.save(tmp_path / f"{name}.npy", a)
    (tmp_path / "adir.npy").mkdir()
    argv = ["predict", "--model", str(export)]
    argv += [
        str(tmp_path / f"{a}.npy") if a in files else str(tmp_path / a) if "." in a else a
        for a in extra
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("zmqps: error: ") and message in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "nowhere").exists()


def test_corrupted_model_exits_2(
    tmp_path: Path, export: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = export / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
    np.save(tmp_path / "x.npy", np.zeros((2, DIM), np.float32))
    assert main(["predict", "--model", str(export), "--input", str(tmp_path / "x.npy")]) == 2
    assert "model.safetensors is corrupted" in capsys.readouterr().err


# -- preprocessing ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Model, dict]:
    """A softmax trained (full batch, a few steps) on the digits, exported as a run does:
    with the digits' preprocessing recorded."""
    train = load_digits("train")
    model = build_model("softmax", 64, 10, seed=0)
    params = {v.name: np.zeros(v.shape, v.dtype) for v in model.variables()}
    for _ in range(60):
        _, grads = model.loss_and_grads(params, train.x, train.y)
        for name, g in grads.items():
            params[name] -= 0.5 * g
    out = tmp_path_factory.mktemp("digits") / "model"
    export_model(out, model.signature(), params, preprocessing=preprocessing("digits"))
    return out, model, params


@pytest.fixture(scope="module")
def raw_digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """All 1797 digits as scikit-learn gives them (0..16), the same scaled, the labels."""
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    folder = tmp_path_factory.mktemp("inputs")
    np.save(folder / "raw.npy", bunch.data)
    np.save(folder / "scaled.npy", bunch.data / 16.0)
    np.save(folder / "y.npy", bunch.target)
    return folder / "raw.npy", folder / "scaled.npy", folder / "y.npy"


def test_raw_digits_score_as_the_scaled_ones(
    digits_export: tuple[Path, Model, dict],
    raw_digits: tuple[Path, Path, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The export says the model takes the digits divided by 16: raw ones are divided."""
    export, model, params = digits_export
    raw, scaled, y = raw_digits
    argv = ["predict", "--model", str(export), "--labels", str(y), "--input"]
    assert main([*argv, str(raw)]) == 0
    raw_out, raw_err = capsys.readouterr()
    assert main([*argv, str(scaled), "--preprocessed"]) == 0
    scaled_out, scaled_err = capsys.readouterr()
    assert raw_out == scaled_out
    assert raw_err == scaled_err and raw_err.startswith("accuracy ")
    assert len(raw_err.splitlines()) == 1  # no warning
    x = np.load(scaled).astype(np.float32)
    want = model.evaluate(params, x, np.load(y))
    assert want["accuracy"] > 0.8  # it learned something
    assert f"accuracy {want['accuracy']:.6f} (" in raw_err
    assert f"loss {want['loss']:.6f}" in raw_err
    assert [int(v) for v in raw_out.split()] == model.predict(params, x).tolist()


@pytest.mark.parametrize(
    ("given", "flag", "first_line"),
    [
        (
            "scaled",
            [],
            "zmqps: warning: input {path}: every value lies in [0, 1] as if already scaled,"
            " but predict will divide raw inputs (range [0, 16]) by 16: give --preprocessed"
            " if they are scaled",
        ),
        (
            "raw",
            ["--preprocessed"],
            "zmqps: warning: input {path}: values in [0, 16], outside the scaled range"
            " [0, 1] that --preprocessed promises; leave it out to divide raw inputs"
            " (range [0, 16]) by 16",
        ),
    ],
    ids=["scaled-given-as-raw", "raw-given-as-scaled"],
)
def test_values_that_contradict_the_preprocessing_warn_once(
    digits_export: tuple[Path, Model, dict],
    raw_digits: tuple[Path, Path, Path],
    capsys: pytest.CaptureFixture[str],
    given: str,
    flag: list[str],
    first_line: str,
) -> None:
    export, _, _ = digits_export
    path = raw_digits[0] if given == "raw" else raw_digits[1]
    argv = ["predict", "--model", str(export), "--input", str(path), "--labels"]
    assert main([*argv, str(raw_digits[2]), *flag]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == first_line.format(path=path)
    assert len(lines) == 2 and lines[1].startswith("accuracy ")  # one warning line, then on
    assert len(out.split()) == 1797


def test_an_export_without_preprocessing_takes_inputs_as_they_are(
    tmp_path: Path,
    export: Path,
    model: Model,
    params: dict[str, np.ndarray],
    data: tuple[np.ndarray, np.ndarray],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An export written before the record existed: no scaling, no warning, either way."""
    x, _ = data
    np.save(tmp_path / "x.npy", x * 40)
    argv = ["predict", "--model", str(export), "--input", str(tmp_path / "x.npy")]
    for flag in ([], ["--preprocessed"]):
        assert main([*argv, *flag]) == 0
        out, err = capsys.readouterr()
        assert [int(v) for v in out.split()] == model.predict(params, x * 40).tolist()
        assert err == ""


def test_predictions_that_cannot_be_written_are_one_line_and_exit_1(
    tmp_path: Path,
    export: Path,
    data: tuple[np.ndarray, np.ndarray],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A disk that fills up as the predictions are written: one line naming the file."""

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    np.save(tmp_path / "x.npy", data[0])
    monkeypatch.setattr(np, "savetxt", full)
    out = tmp_path / "p.csv"
    argv = ["predict", "--model", str(export), "--input", str(tmp_path / "x.npy")]
    assert main([*argv, "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"zmqps: error: cannot write the predictions to {out}: No space left on device"


def test_output_names_are_written_as_given_and_a_writable_file_is_enough(
    tmp_path: Path,
    export: Path,
    data: tuple[np.ndarray, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``out.NPY`` is written as named (not ``out.NPY.npy``); an existing writable file
    in a folder this user cannot write to is written (only new files need the folder)."""
    np.save(tmp_path / "x.npy", data[0])
    argv = ["predict", "--model", str(export), "--input", str(tmp_path / "x.npy")]
    upper = tmp_path / "out.NPY"
    assert main([*argv, "--output", str(upper)]) == 0
    assert sorted(p.name for p in tmp_path.glob("out*")) == ["out.NPY"]
    assert np.load(upper).shape == (len(data[0]),)
    folder = tmp_path / "ro"
    folder.mkdir()
    there = folder / "p.csv"
    there.write_text("")
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: Path(p) != folder and access(p, m))
    assert main([*argv, "--output", str(there)]) == 0
    assert len(there.read_text().splitlines()) == len(data[0])
    assert main([*argv, "--output", str(folder / "new.csv")]) == 2
