"""The length predictor: prompt features from token ids, the ridge and refinement fits on
synthetic data with a known signal, the saved file's round trip, the oracle file, Kendall's tau."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.config.schedule import ScheduleConfig
from loadwise.measure.stats import kendall_tau_b
from loadwise.sched.features import COUNT_FEATURES, TokenClasses, prompt_features
from loadwise.sched.predictor import (
    ArrivalModel,
    LengthPredictor,
    OracleLengths,
    PredictorError,
    ids_key,
    load_predictor,
)
from loadwise.sched.train import (
    PredictorConfig,
    PredictorTrainError,
    arrival_model,
    evaluate,
    refine_model,
    split,
    token_classes,
)

PIECES = ["<s>", "<|im_start|>", "\n", " hello", "world", "?", " why", "```", " code", "x"]
CLASSES = TokenClasses.from_pieces(PIECES, [1], vocab=[6, 8])


def test_token_classes_from_the_pieces() -> None:
    assert CLASSES.newline == {2} and CLASSES.question == {5} and CLASSES.fence == {7}
    assert CLASSES.turn == {1} and CLASSES.word_start == {3, 6, 8}
    assert TokenClasses.from_json(json.loads(json.dumps(CLASSES.to_json()))) == CLASSES


def test_prompt_features_count_what_the_ids_hold() -> None:
    ids = [1, 3, 4, 2, 6, 5, 2, 7, 8, 7]
    f = dict(zip(COUNT_FEATURES, prompt_features(ids, CLASSES), strict=False))
    assert f["log_tokens"] == pytest.approx(math.log1p(10))
    assert f["log_words"] == pytest.approx(math.log1p(3))
    assert f["log_lines"] == pytest.approx(math.log1p(2))
    assert (f["fences"], f["questions"], f["turns"]) == (2, 1, 1)
    assert prompt_features(ids, CLASSES)[len(COUNT_FEATURES):] == [1.0, 1.0]
    assert prompt_features([1, 3], CLASSES)[len(COUNT_FEATURES):] == [0.0, 0.0]
    assert len(prompt_features([], CLASSES)) == CLASSES.num_features


class FakeTokenizer:
    def __len__(self) -> int:
        return len(PIECES)

    def decode(self, ids: list[int]) -> str:
        return PIECES[ids[0]]

    def convert_tokens_to_ids(self, t: str) -> int | None:
        return PIECES.index(t) if t in PIECES else None


def test_token_classes_leave_the_template_out_of_the_vocab() -> None:
    prompts = [[1, 2, 6], [1, 2, 8], [1, 2, 6, 9], [1, 2, 3]]
    classes = token_classes(FakeTokenizer(), prompts, vocab_size=2)
    assert 1 not in classes.vocab and 2 not in classes.vocab  # in every prompt
    assert 6 in classes.vocab and len(classes.vocab) == 2


# --- fits on synthetic data with a known signal ------------------------------------------
def synthetic(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6))
    h = rng.normal(size=(n, 16)).astype(np.float32)
    # Half the signal in the prompt features, half only in the hidden state (non-linear).
    y = 4.0 + 0.8 * x[:, 0] - 0.5 * x[:, 1] + 0.9 * np.maximum(h[:, 3], 0) + 0.1 * rng.normal(size=n)
    return x, h, y


def test_the_arrival_fit_finds_the_signal_and_the_refinement_adds_the_rest() -> None:
    x, h, y = synthetic(600)
    cfg = PredictorConfig(model="m", out_dir="o", epochs=400, lr=3e-3, weight_decay=1e-3)
    train, val, test = split(len(y), cfg)
    arrival, fit = arrival_model(x, y, train, val)
    assert fit["ridge_lambda"] in (0.1, 1.0, 10.0)
    mu1 = np.asarray([arrival.predict(r) for r in x])
    refine, _ = refine_model(h, mu1, y, train, val, cfg)
    mu2 = refine.predict(h, mu1)
    first, second = evaluate(mu1[test], arrival.sigma, y[test]), evaluate(mu2[test],
                                                                          refine.sigma, y[test])
    assert first["kendall_tau"] > 0.5
    assert second["kendall_tau"] > first["kendall_tau"] + 0.1
    assert second["rmse_log"] < 0.7 * first["rmse_log"]
    # sigma is the validation error, so the intervals are roughly calibrated on the test split.
    assert 0.75 <= second["within_90pct_interval"] <= 1.0


def test_a_saved_predictor_predicts_the_same(tmp_path: Path) -> None:
    _, h, y = synthetic(200)
    cfg = PredictorConfig(model="m", out_dir=str(tmp_path), epochs=30)
    train, val, _ = split(len(y), cfg)
    classes = TokenClasses.from_pieces(PIECES, [1], vocab=[3])
    feats = np.asarray([prompt_features([1, 3] * (i % 5 + 1), classes) for i in range(len(y))])
    arrival, _ = arrival_model(feats, y, train, val)
    mu1 = np.asarray([arrival.predict(r) for r in feats])
    refine, _ = refine_model(h, mu1, y, train, val, cfg)
    LengthPredictor(classes, arrival, refine, {"note": "test"}).save(tmp_path)
    back = LengthPredictor.load(tmp_path)
    assert back.predict_arrival([1, 3, 1, 3]) == LengthPredictor(
        classes, arrival, refine).predict_arrival([1, 3, 1, 3])
    assert back.refine is not None
    np.testing.assert_allclose(back.refine.predict(h[:5], mu1[:5]), refine.predict(h[:5], mu1[:5]),
                               rtol=1e-6)
    assert back.meta == {"note": "test"}


def test_bad_predictor_files_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(PredictorError, match="holds no predictor.json"):
        LengthPredictor.load(tmp_path)
    (tmp_path / "predictor.json").write_text("{not json")
    with pytest.raises(PredictorError, match="not a predictor"):
        LengthPredictor.load(tmp_path)
    (tmp_path / "predictor.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(PredictorError, match="train it again"):
        LengthPredictor.load(tmp_path)
    with pytest.raises(PredictorTrainError, match="--num-prompts"):
        PredictorConfig(model="m", out_dir="o", num_prompts=3)


def test_the_oracle_reads_true_lengths_by_prompt_ids(tmp_path: Path) -> None:
    path = tmp_path / "oracle.json"
    OracleLengths({ids_key([1, 2, 3]): 40, ids_key([4]): 7, ids_key([5]): 100}).save(path)
    oracle = OracleLengths.load(path)
    assert oracle.predict_arrival([1, 2, 3])[0] == pytest.approx(math.log(40))
    assert oracle.predict_arrival([9, 9])[0] == pytest.approx(math.log(40))  # the median
    cfg = ScheduleConfig("srpt", oracle_file=str(path))
    assert isinstance(load_predictor(cfg), OracleLengths)
    path.write_text("[]")
    with pytest.raises(PredictorError, match="not an oracle lengths file"):
        OracleLengths.load(path)


def test_arrival_model_round_trips() -> None:
    m = ArrivalModel((0.0, 1.0), (1.0, 2.0), (0.5, -0.5), 3.0, 0.7)
    assert ArrivalModel.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert m.predict([2.0, 3.0]) == pytest.approx(3.0 + 1.0 - 0.5)


# --- Kendall's tau-b ----------------------------------------------------------------------
def brute_tau_b(a: list[float], b: list[float]) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    s = sum(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]) for i, j in pairs)
    ta = sum(1 for i, j in pairs if a[i] != a[j])
    tb = sum(1 for i, j in pairs if b[i] != b[j])
    return 0.0 if ta == 0 or tb == 0 else float(s / math.sqrt(ta * tb))


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=2, max_size=30))
def test_kendall_tau_b_matches_its_definition(pairs: list[tuple[int, int]]) -> None:
    a, b = [float(p[0]) for p in pairs], [float(p[1]) for p in pairs]
    assert kendall_tau_b(a, b) == pytest.approx(brute_tau_b(a, b), abs=1e-12)
    assert kendall_tau_b(a, b) == pytest.approx(kendall_tau_b(b, a), abs=1e-12)


def test_kendall_tau_b_extremes() -> None:
    rng = random.Random(1)
    xs = [rng.random() for _ in range(50)]
    assert kendall_tau_b(xs, xs) == pytest.approx(1.0)
    assert kendall_tau_b(xs, [-x for x in xs]) == pytest.approx(-1.0)
    assert kendall_tau_b(xs, [1.0] * 50) == 0.0
    with pytest.raises(ValueError):
        kendall_tau_b([1.0], [2.0])
