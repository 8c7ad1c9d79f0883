"""One quantization evaluation: a method and a spec, perplexity on a text. A ``Session`` keeps
the float32 model, the tokenized texts and the calibration segments between evaluations (each
method starts from a fresh copy of the float32 model).

Data: calibration segments come from PTB's train split; SmoothQuant's α is chosen on PTB's
valid split (``alpha_windows`` windows); perplexity is reported on PTB's test split or a text
file no calibration or choice saw."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loadwise.quant import data, hessian, llama, methods, ppl
from loadwise.quant.calibration import Calibration
from loadwise.quant.catalog import (
    ALPHA_WINDOWS,
    CALIB_SEGMENTS,
    CALIB_TOKENS,
    SMOOTH_ALPHAS,
    HessianParams,
    MethodError,
    QuantMethod,
    RotationParams,
    SmoothQuantParams,
)
from loadwise.quant.methods import Progress
from loadwise.quant.ppl import Perplexity
from loadwise.quant.sim import Prepared, simulate
from loadwise.quant.spec import QuantSpec

PTB_TEST = "ptb"


@dataclass(frozen=True)
class EvalConfig:
    method: QuantMethod  # with its parameters (SmoothQuant's alpha None: searched on PTB valid)
    spec: QuantSpec
    text: str = PTB_TEST  # "ptb" (its test split) or a file's path
    max_windows: int | None = None  # None: every 2048-token window of the text
    alpha_windows: int = ALPHA_WINDOWS
    calib_segments: int = CALIB_SEGMENTS
    calib_tokens: int = CALIB_TOKENS
    seed: int = 0  # which calibration segments
    # How the integer GEMM sums W8A8's products (sim.ACCUMULATIONS): int32 is exact.
    accumulation: str = "int32"

    def __post_init__(self) -> None:
        params = self.method.params
        if isinstance(params, HessianParams) and params.segments > self.calib_segments:
            raise MethodError(f"--hessian-segments must be at most the calibration segments "
                              f"({self.calib_segments}), got {params.segments}")

    def to_json(self) -> dict[str, Any]:
        # The method's name stays a field of its own: summaries of every record read it.
        return {"method": self.method.name, "params": self.method.params.to_json(),
                "spec": self.spec.to_json(), "text": self.text,
                "max_windows": self.max_windows, "alpha_windows": self.alpha_windows,
                "calib_segments": self.calib_segments, "calib_tokens": self.calib_tokens,
                "seed": self.seed, "accumulation": self.accumulation}

    @classmethod
    def from_json(cls, c: dict[str, Any]) -> EvalConfig:
        qm = QuantMethod.from_json({"name": c["method"], **c["params"]}) if "params" in c \
            else _named_method(c)
        return cls(qm, QuantSpec.from_json(c["spec"]), c["text"], c["max_windows"],
                   c["alpha_windows"], c["calib_segments"], c["calib_tokens"], c["seed"],
                   c.get("accumulation", "int32"))


def _named_method(c: dict[str, Any]) -> QuantMethod:
    """The method of a record written before methods carried their parameters: they sat
    beside the config's other fields (the earliest records have no hessian field)."""
    name = c["method"]
    if name == "smoothquant":
        return QuantMethod(name, SmoothQuantParams(c["alpha"]))
    if name == "rotation":
        return QuantMethod(name, RotationParams(c["seed"]))
    if name == "hessian":
        return QuantMethod.from_json({"name": name, **c.get("hessian", {})})
    return QuantMethod(name)


@dataclass(frozen=True)
class EvalRecord:
    config: EvalConfig
    perplexity: Perplexity
    alpha: float | None  # the α used (SmoothQuant)
    alpha_search: dict[str, float] = field(default_factory=dict)  # α -> PTB valid perplexity
    prepare_s: float = 0.0
    eval_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config.to_json(), "perplexity": self.perplexity.to_json(),
                "alpha": self.alpha, "alpha_search": self.alpha_search,
                "prepare_s": self.prepare_s, "eval_s": self.eval_s}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EvalRecord:
        return cls(EvalConfig.from_json(d["config"]), Perplexity.from_json(d["perplexity"]),
                   d["alpha"], d["alpha_search"], d["prepare_s"], d["eval_s"])


class Session:
    def __init__(self, model_dir: Path, progress: Progress | None = None,
                 work_root: Path | None = None) -> None:
        from transformers import AutoTokenizer

        from loadwise.model import loadwise_home

        self.model_dir = model_dir
        # The hessian method's finished layers, one directory per (config, spec, model): the
        # same command run again resumes (or reads a finished run back).
        self.work_root = work_root or loadwise_home() / "quant-runs"
        self.base = llama.load(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.progress = progress
        self._ids: dict[str, torch.Tensor] = {}
        self._calib: dict[tuple[int, int, int], Calibration] = {}
        # Weights as prepared by a method (GPTQ's take minutes): reused by every spec that
        # quantizes the weights the same way (W4A4 and W4A4KV4, another text).
        self._prepared: dict[tuple[Any, ...], tuple[Any, Prepared]] = {}

    def ids(self, text: str) -> torch.Tensor:
        """``text``: ``ptb`` (test), ``ptb:<split>`` or a file path."""
        if text not in self._ids:
            if text == PTB_TEST:
                raw = data.ptb("test")
            elif text.startswith("ptb:"):
                raw = data.ptb(text.removeprefix("ptb:"))
            else:
                raw = data.text_file(Path(text))
            self._ids[text] = data.tokens(self.tokenizer, raw)
        return self._ids[text]

    def calibration(self, cfg: EvalConfig) -> Calibration:
        key = (cfg.calib_segments, cfg.calib_tokens, cfg.seed)
        if key not in self._calib:
            self._calib[key] = Calibration(
                lambda: data.calibration_segments(self.ids("ptb:train"), *key))
        return self._calib[key]

    def quantized(self, cfg: EvalConfig, qm: QuantMethod, keep: bool = True) -> Any:
        """The model ``cfg`` describes, quantized by ``qm`` (``cfg``'s method with every
        parameter chosen); ``keep``: remember its weights for the next spec that quantizes them
        the same way."""
        if not qm.info.quantizes:
            return self.base
        key: tuple[Any, ...] = (qm, cfg.spec.weights, cfg.seed, cfg.calib_segments,
                                cfg.calib_tokens)
        if qm.info.joint:  # its choices depend on every format
            key += (cfg.spec,)
        if key in self._prepared:
            model, prepared = self._prepared[key]
            return simulate(copy.deepcopy(model), cfg.spec, prepared, cfg.accumulation)
        model = copy.deepcopy(self.base)
        prepared = methods.prepare(model, qm, cfg.spec, self.calibration(cfg), self.progress,
                                   self.workdir(cfg))
        if keep:
            self._prepared[key] = (model, prepared)
            model = copy.deepcopy(model)
        return simulate(model, cfg.spec, prepared, cfg.accumulation)

    def workdir(self, cfg: EvalConfig) -> Path | None:
        """Where the hessian method keeps its finished layers for ``cfg`` (None: other
        methods)."""
        params = cfg.method.params
        if not isinstance(params, HessianParams):
            return None
        return hessian.run_dir(params, self.work_root, cfg.spec, self.model_dir,
                               cfg.calib_segments, cfg.calib_tokens, cfg.seed)

    def forget(self) -> None:
        """Drop the prepared weights (memory: one float32 model each)."""
        self._prepared.clear()

    def choose_alpha(self, cfg: EvalConfig) -> tuple[float, dict[str, float]]:
        wins = ppl.windows(self.ids("ptb:valid"), max_windows=cfg.alpha_windows)
        search = {}
        for a in SMOOTH_ALPHAS:
            model = self.quantized(cfg, cfg.method.with_params(alpha=a), keep=False)
            search[f"{a:g}"] = ppl.perplexity(model, wins).ppl
        best = min(search, key=lambda a: search[a])
        return float(best), search

    def evaluate(self, cfg: EvalConfig) -> EvalRecord:
        t0 = time.perf_counter()
        qm, search = cfg.method, dict[str, float]()
        if isinstance(qm.params, SmoothQuantParams) and qm.params.alpha is None:
            chosen, search = self.choose_alpha(cfg)
            qm = qm.with_params(alpha=chosen)
        model = self.quantized(cfg, qm)
        t1 = time.perf_counter()
        wins = ppl.windows(self.ids(cfg.text), max_windows=cfg.max_windows)
        progress = self.progress
        step = (lambda i, n: progress("windows", i, n)) if progress else None
        result = ppl.perplexity(model, wins, step)
        alpha = qm.params.alpha if isinstance(qm.params, SmoothQuantParams) else None
        return EvalRecord(cfg, result, alpha, search, t1 - t0, time.perf_counter() - t1)
