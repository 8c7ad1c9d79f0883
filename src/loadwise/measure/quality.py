"""Whether a server's answers are the reference server's: greedy agreement and perplexity, both
read through vLLM's OpenAI API (no model code here). A lower-precision dtype changes answers;
the settings rule deploys one only when these stay within its bar (policy.settings.QualityBar).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import requests


@dataclass(frozen=True, slots=True)
class AnswerQuality:
    candidate: str
    reference: str
    num_prompts: int
    answer_tokens: int  # greedy tokens compared per prompt
    agreement: float  # share of prompts whose greedy answers are identical
    num_text_tokens: int  # tokens scored for perplexity
    perplexity: float
    reference_perplexity: float

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.reference_perplexity

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "perplexity_ratio": self.perplexity_ratio}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AnswerQuality:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def greedy_answer(url: str, model: str, prompt: str, max_tokens: int) -> str:
    """The server's greedy chat answer to ``prompt`` (exactly ``max_tokens`` tokens)."""
    body: dict[str, Any] = {"model": model, "temperature": 0.0, "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}]}
    resp = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    resp.raise_for_status()
    return str(resp.json()["choices"][0]["message"]["content"])


def text_logprobs(url: str, model: str, text: str | Sequence[int]) -> list[float]:
    """The log-probability of every token of ``text`` (a string, or token ids scored as they
    are) after the first, as the server scores it (vLLM's ``echo`` with ``logprobs``)."""
    prompt = text if isinstance(text, str) else list(text)
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 1,
                            "temperature": 0.0, "echo": True, "logprobs": 0}
    resp = requests.post(f"{url}/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    lps = resp.json()["choices"][0]["logprobs"]["token_logprobs"]
    # The first token has no log-probability; the last is the one generated token.
    return [float(x) for x in lps[1:-1] if x is not None]


def perplexity(logprobs: Sequence[float]) -> float:
    if not logprobs:
        raise ValueError("no token scored")
    return math.exp(-sum(logprobs) / len(logprobs))


def compare_answers(candidate: tuple[str, str], reference: tuple[str, str], model: str,
                    prompts: Sequence[str], answer_tokens: int, texts: Sequence[str]
                    ) -> AnswerQuality:
    """``candidate`` and ``reference`` are (name, url). Greedy answers to ``prompts`` are
    compared whole; perplexity is over every token of ``texts``, pooled."""
    same = sum(greedy_answer(candidate[1], model, p, answer_tokens)
               == greedy_answer(reference[1], model, p, answer_tokens) for p in prompts)
    cand = [x for t in texts for x in text_logprobs(candidate[1], model, t)]
    ref = [x for t in texts for x in text_logprobs(reference[1], model, t)]
    return AnswerQuality(candidate[0], reference[0], len(prompts), answer_tokens,
                         same / len(prompts), len(ref), perplexity(cand), perplexity(ref))
