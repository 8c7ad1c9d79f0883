"""Time to the first token of a long prompt when its prefix is computed, found in vLLM's own
prefix cache, or loaded from loadwise's store: where the rest of a store hit's time goes.

One in-process engine with loadwise's store. Per round, three prompts are sent one at a time,
one output token each, sharing a prefix of about 1,500 tokens (12 blocks) and each ending in its
own suffix:
  * ``computed``: a new prefix (round-specific), everything computed;
  * ``local``: that same prefix again, now in vLLM's prefix cache;
  * ``store``: the prefix again after vLLM's cache was reset, so it comes from the store.
Rounds repeat with new prefixes; the engine's time per request is the wall time of
``LLM.generate``.

Usage: python benchmarks/kv_hit_ttft.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from results_io import write_result

from loadwise.config.binding import CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.config.kvstore import KvStoreConfig
from loadwise.kvstore.stats import read_stats
from loadwise.model import prepare
from loadwise.provenance import provenance
from loadwise.vllm.local import LocalEngine

TEXT = ("The harbour town woke slowly: gulls over the nets, a bell from the chapel, carts on the "
        "cobbles, and the smell of bread from the bakery by the quay. ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefix-repeats", type=int, default=40, help="copies of the text in the prefix")
    p.add_argument("--cpu-binding", default="all")
    args = p.parse_args()
    made_by = provenance()  # the code that runs, before anything can change the tree
    from vllm import SamplingParams

    store = tempfile.mkdtemp(prefix="kv-hit-")
    spec = EngineSpec(model=str(prepare().path), spec_method=None, enforce_eager=True,
                      max_num_seqs=4, max_model_len=4096, kv_cache_space_gib=1,
                      cpu_binding=CpuBinding.parse(args.cpu_binding),
                      extensions=(KvStoreConfig(store, 2.0),))
    engine = LocalEngine(spec)
    one = SamplingParams(max_tokens=1, temperature=0)
    samples: dict[str, list[float]] = {"computed": [], "local": [], "store": []}
    cached: dict[str, list[int]] = {k: [] for k in samples}
    prompt_tokens = 0
    try:
        for r in range(args.rounds):
            prefix = f"Round {r}. " + TEXT * args.prefix_repeats
            for kind in ("computed", "local", "store"):
                if kind == "store":
                    engine.llm.reset_prefix_cache()
                    time.sleep(1.0)  # the writer thread has the prefix's blocks on disk by now
                prompt = engine.chat_prompt(prefix + f"\n\nQuestion {kind}: what happens next?")
                t0 = time.perf_counter()
                out = engine.llm.generate([prompt], one, use_tqdm=False)[0]
                samples[kind].append(time.perf_counter() - t0)
                cached[kind].append(int(out.num_cached_tokens or 0))
                prompt_tokens = len(out.prompt_token_ids or [])
    finally:
        engine.shutdown()
    stats = read_stats(store)
    summary = {k: {"median_s": statistics.median(v), "cached_tokens_median":
                   statistics.median(cached[k])} for k, v in samples.items()}
    for k, v in summary.items():
        print(f"{k:9s} median {v['median_s']:.3f} s, cached {v['cached_tokens_median']:.0f} "
              f"of {prompt_tokens} tokens")
    path = write_result("kv-hit-ttft", {
        **made_by, "cpu_binding": spec.cpu_binding.name, "config": vars(args),
        "engine": {"enforce_eager": True, "max_model_len": 4096}, "prompt_tokens": prompt_tokens,
        "samples_s": samples, "cached_tokens": cached, "summary": summary,
        "connector": stats})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
