"""Perplexity in the papers' way: the text cut into non-overlapping windows of 2048 tokens
(the remainder dropped), each window scored on its own; perplexity is exp of the mean
per-token negative log-likelihood over all windows. The 95 % interval treats windows as the
independent unit: exp(mean ± t · sd / √n) over per-window mean NLLs."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loadwise.quant.data import TextError

WINDOW_TOKENS = 2048
# Two-sided 97.5 % Student t quantiles for small n (n-1 degrees of freedom); 1.96 beyond.
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
         10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04, 40: 2.02, 60: 2.00}


def t975(dof: int) -> float:
    keys = [k for k in sorted(_T975) if k <= dof]
    return _T975[keys[-1]] if dof <= 60 and keys else 1.96


@dataclass(frozen=True)
class Perplexity:
    window_nll: tuple[float, ...]  # mean NLL per token, per window
    window_tokens: int

    @property
    def nll(self) -> float:
        return statistics.fmean(self.window_nll)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def ci95(self) -> tuple[float, float]:
        n = len(self.window_nll)
        if n < 2:
            return (self.ppl, self.ppl)
        half = t975(n - 1) * statistics.stdev(self.window_nll) / math.sqrt(n)
        return (math.exp(self.nll - half), math.exp(self.nll + half))

    def to_json(self) -> dict[str, Any]:
        lo, hi = self.ci95
        return {"ppl": self.ppl, "ci95": [lo, hi], "window_tokens": self.window_tokens,
                "window_nll": list(self.window_nll)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Perplexity:
        return cls(tuple(d["window_nll"]), d["window_tokens"])


def windows(ids: torch.Tensor, window_tokens: int = WINDOW_TOKENS,
            max_windows: int | None = None) -> torch.Tensor:
    """The text's non-overlapping windows ``[n, window_tokens]``; with ``max_windows``, that
    many spread evenly over the text (the same ones for every method)."""
    n = ids.numel() // window_tokens
    if n == 0:
        raise TextError(f"the text has {ids.numel()} tokens, fewer than one {window_tokens}-token "
                        "window")
    all_windows = ids[:n * window_tokens].reshape(n, window_tokens)
    if max_windows is None or max_windows >= n:
        return all_windows
    pick = [round(i * (n - 1) / max(max_windows - 1, 1)) for i in range(max_windows)]
    return all_windows[pick]


@torch.no_grad()
def perplexity(model: Any, wins: torch.Tensor,
               progress: Callable[[int, int], None] | None = None) -> Perplexity:
    nlls = []
    for i, w in enumerate(wins):
        logits = model(w[None, :], use_cache=False).logits[0, :-1].float()
        nlls.append(torch.nn.functional.cross_entropy(logits, w[1:]).item())
        if progress:
            progress(i + 1, len(wins))
    return Perplexity(tuple(nlls), int(wins.shape[1]))
