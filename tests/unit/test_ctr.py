"""The CTR workload: synthetic data with a known optimum, the Criteo text format, AUC and
log loss, and the wide-and-deep model's gradients."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from zmqps.data.ctr import (
    CRITEO_CATEGORICAL,
    CRITEO_INTEGER,
    auc,
    field_ids,
    load_ctr,
    logloss,
    read_criteo,
    read_ctr_text,
    synthetic_ctr,
    write_criteo,
    write_ctr_text,
)
from zmqps.models.ctr import CTRModel, SparseBatch


def test_synthetic_data_is_deterministic_power_law_and_calibrated() -> None:
    a = synthetic_ctr(20_000, fields=3, vocab=100, seed=4)
    b = synthetic_ctr(20_000, fields=3, vocab=100, seed=4)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.y, b.y)
    test = synthetic_ctr(5000, fields=3, vocab=100, seed=4, split="test")
    assert not np.array_equal(test.ids[:100], a.ids[:100])
    # Zipf: the most frequent value of a field is far more common than the 50th
    _, counts = np.unique(a.ids[:, 0], return_counts=True)
    counts = np.sort(counts)[::-1]
    assert counts[0] > 20 * counts[49]
    # ids of different fields never collide, and some are negative (any int64)
    assert not set(a.ids[:, 0].tolist()) & set(a.ids[:, 1].tolist())
    assert (a.ids < 0).any()
    # labels follow the true probabilities
    assert abs(a.y.mean() - a.p_true.mean()) < 0.01
    assert 0.7 < auc(a.y, a.p_true) < 0.97


def test_auc_and_logloss_match_brute_force() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 60).astype(np.float32)
    s = np.round(rng.random(60), 1)  # many ties
    pairs = [(i, j) for i, j in itertools.product(range(60), range(60)) if y[i] and not y[j]]
    brute = sum(1.0 if s[i] > s[j] else 0.5 if s[i] == s[j] else 0.0 for i, j in pairs)
    assert auc(y, s) == pytest.approx(brute / len(pairs), abs=1e-12)
    p = np.clip(rng.random(60), 0.01, 0.99)
    want = -np.mean([np.log(p[k]) if y[k] else np.log(1 - p[k]) for k in range(60)])
    assert logloss(y, p) == pytest.approx(want)
    with pytest.raises(ValueError, match="both"):
        auc(np.ones(3), np.ones(3))


def test_criteo_text_format_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    n = 50
    labels = rng.integers(0, 2, n)
    ints = rng.integers(-1, 1000, (n, CRITEO_INTEGER))  # -1: missing
    cats = rng.integers(-1, 2**32, (n, CRITEO_CATEGORICAL))
    path = tmp_path / "train.txt"
    write_criteo(path, labels, ints, cats)
    first = path.read_text().splitlines()[0].split("\t")
    assert len(first) == 1 + CRITEO_INTEGER + CRITEO_CATEGORICAL
    data = read_criteo(path)
    assert len(data) == n and data.num_dense == 13 and data.num_fields == 26
    assert np.array_equal(data.y, labels.astype(np.float32))
    np.testing.assert_allclose(data.dense, np.log1p(np.maximum(ints, 0)), rtol=1e-6)
    for f in (0, 25):
        present = cats[:, f] >= 0
        assert np.array_equal(data.ids[present, f], field_ids(f, cats[present, f]))
        # every missing value of a field shares one id, distinct from present values
        missing = data.ids[~present, f]
        assert len(set(missing.tolist())) <= 1
        assert not set(missing.tolist()) & set(data.ids[present, f].tolist())
    # the job's split: the last tenth held out
    train = load_ctr("criteo", "train", 0, 0, str(tmp_path))
    test = load_ctr("criteo", "test", 0, 0, str(tmp_path))
    assert (len(train), len(test)) == (45, 5)
    assert np.array_equal(test.ids, data.ids[45:])
    assert len(read_criteo(path, limit=7)) == 7


def test_synthetic_text_round_trip_with_and_without_labels(tmp_path: Path) -> None:
    data = synthetic_ctr(200, fields=5, vocab=30, num_dense=3, seed=2, split="test")
    assert data.raw is not None and np.array_equal(data.take(slice(3, 9)).raw, data.raw[3:9])
    for labels in (True, False):
        path = tmp_path / f"{labels}.txt"
        write_ctr_text(path, data, labels=labels)
        ids, dense, y, raw = read_ctr_text(path, fields=5, num_dense=3, dense="raw")
        assert np.array_equal(ids, data.ids) and np.array_equal(raw, data.raw)
        assert np.array_equal(dense, data.dense) and dense.dtype == np.float32  # exact
        assert (y is not None) == labels and (y is None or np.array_equal(y, data.y))
    with pytest.raises(ValueError, match=r"True\.txt:1: 9 fields, expected 8"):
        read_ctr_text(tmp_path / "True.txt", fields=5, num_dense=3, dense="raw", label=False)
    with pytest.raises(ValueError, match=r"False\.txt:1: 8 fields, expected 9"):
        read_ctr_text(tmp_path / "False.txt", fields=5, num_dense=3, dense="raw", label=True)
    mixed = tmp_path / "mixed.txt"
    lines = (tmp_path / "True.txt").read_text().splitlines(True)[:2]
    mixed.write_text(lines[0] + lines[1].split("\t", 1)[1])
    with pytest.raises(ValueError, match=r"mixed\.txt:2: 8 fields, expected 9"):
        read_ctr_text(mixed, fields=5, num_dense=3, dense="raw")


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("1\t2\t3", "fields"),
        ("2" + "\t" * 39, "label"),
        ("1\tx" + "\t" * 38, "invalid literal"),
        ("1" + "\t" * 14 + "zz" + "\t" * 25, "invalid literal"),
    ],
)
def test_bad_criteo_lines_are_refused_with_their_line(
    tmp_path: Path, line: str, error: str
) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("0" + "\t" * 39 + "\n" + line + "\n")
    with pytest.raises(ValueError, match=error) as info:
        read_criteo(path)
    assert "bad.txt:2" in str(info.value)


def test_sparse_batch_deduplicates_gathers_and_sums() -> None:
    ids = np.array([[5, -3], [5, 9], [-3, -3]], np.int64)
    sb = SparseBatch.of(ids)
    assert sb.unique.tolist() == [-3, 5, 9]
    rows = np.array([[1.0], [2.0], [3.0]])
    assert sb.gather(rows)[:, :, 0].tolist() == [[2.0, 1.0], [2.0, 3.0], [1.0, 1.0]]
    g = np.arange(6, dtype=np.float64).reshape(3, 2, 1)
    assert sb.scatter(g)[:, 0].tolist() == [1 + 4 + 5, 0 + 2, 3]


def test_model_gradients_match_finite_differences() -> None:
    data = synthetic_ctr(16, fields=3, vocab=5, num_dense=2, seed=2)
    model = CTRModel(3, 2, dim=2, hidden=4, buckets=8)
    rng = np.random.default_rng(0)
    params = {v.name: rng.normal(0, 0.5, v.shape) for v in model.variables() if not v.sparse}
    sb = SparseBatch.of(data.ids)
    rows = {
        model.WIDE: rng.normal(0, 0.5, (sb.unique.size, 1)),
        model.EMB: rng.normal(0, 0.5, (sb.unique.size, 2)),
    }
    dense, y = data.dense.astype(np.float64), data.y.astype(np.float64)
    loss, grads, row_grads = model.loss_and_grads(params, rows, sb, dense, y)

    def f() -> float:
        return model.loss_and_grads(params, rows, sb, dense, y)[0]

    eps = 1e-6
    for table, arrays in ((grads, params), (row_grads, rows)):
        for name, g in table.items():
            arr = arrays[name]
            for idx in list(np.ndindex(arr.shape))[:12]:
                old = arr[idx]
                arr[idx] = old + eps
                up = f()
                arr[idx] = old - eps
                down = f()
                arr[idx] = old
                assert g[idx] == pytest.approx((up - down) / (2 * eps), abs=1e-6), (name, idx)
    assert loss == pytest.approx(f())
