"""The output-length predictor the scheduler runs: pure inference (numpy; no torch, no vLLM).

Two stages, both predicting mu = E[log L] for a request's output length L in tokens, each with
the spread sigma of its errors on log L measured on held-out prompts (the scheduler treats L as
log-normal around the prediction):

* **arrival**: ridge regression on the prompt's features (``loadwise.sched.features``);
* **refinement**: after the first decode step, a two-layer network on the model's final hidden
  state at the prompt's last token (what produced the first output token) plus the arrival
  prediction; it outputs a correction to the arrival prediction.

``max_tokens`` is not a feature: the prediction is of the length the model would write, and the
scheduler caps the expected remaining work at the request's own ``max_tokens``.

Written by ``loadwise predictor train`` as ``predictor.json`` (one file, plain numbers).
``OracleLengths`` reads true lengths from a file: the upper bound benchmarks compare against.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadwise.config.schedule import ScheduleConfig
from loadwise.errors import LoadwiseError
from loadwise.sched.features import TokenClasses, prompt_features

PREDICTOR_FILE = "predictor.json"
FORMAT = 1
ORACLE_SIGMA = 0.01  # an oracle's "spread": exact lengths, kept > 0 for the log-normal formulas


class PredictorError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ArrivalModel:
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    sigma: float

    def predict(self, x: Sequence[float]) -> float:
        z = (np.asarray(x, dtype=np.float64) - self.mean) / self.scale
        return float(z @ np.asarray(self.weights) + self.bias)

    def to_json(self) -> dict[str, Any]:
        return {"mean": list(self.mean), "scale": list(self.scale), "weights": list(self.weights),
                "bias": self.bias, "sigma": self.sigma}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ArrivalModel:
        return cls(tuple(d["mean"]), tuple(d["scale"]), tuple(d["weights"]), float(d["bias"]),
                   float(d["sigma"]))


@dataclass(frozen=True)
class RefineModel:
    """mu2 = mu1 + w2 . relu(W1 z + b1) + b2, z = ([h, mu1] - in_mean) / in_scale."""

    in_mean: np.ndarray
    in_scale: np.ndarray
    w1: np.ndarray  # [hidden, inputs]
    b1: np.ndarray
    w2: np.ndarray  # [hidden]
    b2: float
    sigma: float

    @property
    def hidden_size(self) -> int:
        return int(self.in_mean.shape[0]) - 1

    def predict(self, hidden: np.ndarray, mu1: np.ndarray) -> np.ndarray:
        """[n] refined mu for [n, hidden_size] states and their [n] arrival predictions."""
        x = np.concatenate([np.asarray(hidden, dtype=np.float32),
                            np.asarray(mu1, dtype=np.float32)[:, None]], axis=1)
        z = (x - self.in_mean) / self.in_scale
        h = np.maximum(z @ self.w1.T + self.b1, 0.0)
        out: np.ndarray = np.asarray(mu1, dtype=np.float64) + (h @ self.w2 + self.b2)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"in_mean": self.in_mean.tolist(), "in_scale": self.in_scale.tolist(),
                "w1": self.w1.tolist(), "b1": self.b1.tolist(), "w2": self.w2.tolist(),
                "b2": self.b2, "sigma": self.sigma}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RefineModel:
        def arr(k: str) -> np.ndarray:
            return np.asarray(d[k], dtype=np.float32)

        return cls(arr("in_mean"), arr("in_scale"), arr("w1"), arr("b1"), arr("w2"),
                   float(d["b2"]), float(d["sigma"]))


@dataclass(frozen=True)
class LengthPredictor:
    classes: TokenClasses
    arrival: ArrivalModel
    refine: RefineModel | None
    meta: dict[str, Any] = field(default_factory=dict)

    def predict_arrival(self, prompt_ids: Sequence[int]) -> tuple[float, float]:
        """(mu, sigma) of log output length from the prompt alone."""
        return self.arrival.predict(prompt_features(prompt_ids, self.classes)), self.arrival.sigma

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "classes": self.classes.to_json(),
                "arrival": self.arrival.to_json(),
                "refine": None if self.refine is None else self.refine.to_json(),
                "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LengthPredictor:
        if d.get("format") != FORMAT:
            raise PredictorError(f"predictor format {d.get('format')!r}, this loadwise reads "
                                 f"{FORMAT}: train it again with `loadwise predictor train`")
        refine = d.get("refine")
        return cls(TokenClasses.from_json(d["classes"]), ArrivalModel.from_json(d["arrival"]),
                   None if refine is None else RefineModel.from_json(refine), d.get("meta", {}))

    def save(self, out_dir: str | Path) -> Path:
        path = Path(out_dir) / PREDICTOR_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, predictor_dir: str | Path) -> LengthPredictor:
        path = Path(predictor_dir) / PREDICTOR_FILE
        if not path.is_file():
            raise PredictorError(f"{predictor_dir} holds no {PREDICTOR_FILE}: train one with "
                                 "`loadwise predictor train --out DIR`")
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as exc:
            raise PredictorError(f"{path} is not a predictor loadwise wrote: {exc}") from None


def ids_key(prompt_ids: Sequence[int]) -> str:
    """A prompt's key in an oracle file: its token ids, hashed."""
    return hashlib.sha1(",".join(map(str, prompt_ids)).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class OracleLengths:
    """True output lengths by prompt (``{"lengths": {ids_key: tokens}}``); a prompt not in the
    file gets the file's median length."""

    lengths: dict[str, int]

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths.values()) < 1:
            raise PredictorError("an oracle file needs at least one length, each >= 1")

    def predict_arrival(self, prompt_ids: Sequence[int]) -> tuple[float, float]:
        n = self.lengths.get(ids_key(prompt_ids))
        if n is None:
            n = sorted(self.lengths.values())[len(self.lengths) // 2]
        return math.log(n), ORACLE_SIGMA

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"lengths": self.lengths}))

    @classmethod
    def load(cls, path: str | Path) -> OracleLengths:
        try:
            d = json.loads(Path(path).read_text())
            return cls({str(k): int(v) for k, v in d["lengths"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PredictorError(f"{path} is not an oracle lengths file "
                                 f"({{\"lengths\": {{key: tokens}}}}): {exc}") from None


def load_predictor(cfg: ScheduleConfig) -> LengthPredictor | OracleLengths:
    """The predictor an ordered schedule names (its oracle file or its predictor directory)."""
    if cfg.oracle_file:
        return OracleLengths.load(cfg.oracle_file)
    if not cfg.predictor_dir:
        raise PredictorError(f"--schedule {cfg.policy} needs --predictor DIR or "
                             "--oracle-lengths FILE")
    return LengthPredictor.load(cfg.predictor_dir)
