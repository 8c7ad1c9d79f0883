"""`loadwise demo`: the embedded model served by vLLM with a draft-length table, two requests,
and vLLM's own acceptance counters read back from /metrics."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests
from rich.console import Console
from rich.table import Table

from loadwise.config.engine import EngineSpec
from loadwise.measure.prom import fetch_metrics, spec_counters
from loadwise.vllm.server import ServerProcess

REPETITIVE = (
    "Repeat the following text exactly, word for word:\n\n"
    "The early bird catches the worm, but the second mouse gets the cheese. "
    "A stitch in time saves nine, and a rolling stone gathers no moss."
)
OPEN_ENDED = "Write a short story about a lighthouse keeper who befriends a seagull."


def chat(url: str, model: str, prompt: str, max_tokens: int) -> str:
    resp = requests.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": prompt}],
              "temperature": 0.0, "max_tokens": max_tokens},
        timeout=600,
    )
    resp.raise_for_status()
    return str(resp.json()["choices"][0]["message"]["content"])


def run_demo(spec: EngineSpec, console: Console, max_tokens: int = 96) -> None:
    console.print(f"[bold]starting vLLM[/] on {spec.model} with table "
                  f"{spec.effective_table()} (max k={spec.max_k}) …")
    with ServerProcess(spec) as server:
        console.print(f"server healthy at {server.url}")
        model = spec.model.rstrip("/").split("/")[-1]
        before = spec_counters(fetch_metrics(server.url))
        prompts = {"repetitive": REPETITIVE, "open-ended": OPEN_ENDED}
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = dict(zip(prompts, pool.map(
                lambda p: chat(server.url, model, p, max_tokens), prompts.values())))
        after = spec_counters(fetch_metrics(server.url)).minus(before)
        for name, text in answers.items():
            console.rule(f"{name} prompt")
            console.print(prompts[name], style="dim")
            console.print(text)
        t = Table(title="vLLM spec-decode counters during the demo (/metrics)")
        t.add_column("counter")
        t.add_column("value", justify="right")
        t.add_row("drafts", str(after.num_drafts))
        t.add_row("draft tokens", str(after.num_draft_tokens))
        t.add_row("accepted tokens", str(after.num_accepted_tokens))
        rate = after.acceptance_rate
        t.add_row("acceptance rate", "n/a" if rate is None else f"{rate:.1%}")
        for pos, n in enumerate(after.accepted_per_pos):
            share = n / after.num_drafts if after.num_drafts else 0.0
            t.add_row(f"accepted at position {pos}", f"{n} ({share:.1%} of drafts)")
        console.print(t)
