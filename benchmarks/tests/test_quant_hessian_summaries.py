"""The hessian benchmark's and the sensitivity study's summaries: the best baseline and the
reduction against it per text, the choices counted from a real run's records, and the study's
rank correlations."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from quant_hessian import choices_summary, summarize
from quant_sensitivity import correlations

from loadwise.quant import hessian
from loadwise.quant.catalog import HessianParams
from loadwise.quant.spec import QuantSpec


def run(label: str, method: str, nll: list[float]) -> dict:
    import math
    import statistics
    return {"label": label, "config": {"method": method},
            "perplexity": {"ppl": math.exp(statistics.fmean(nll)), "window_nll": nll}}


def test_the_reduction_is_against_the_best_baseline_on_each_text() -> None:
    runs = [run("ptb x", "rtn", [5.0, 5.2]), run("ptb x", "gptq", [4.0, 4.1]),
            run("ptb x", "smoothquant", [4.2, 4.0]), run("ptb x", "hessian", [3.9, 4.0]),
            run("other x", "rtn", [2.0, 2.0]), run("other x", "hessian", [2.1, 2.1])]
    s = summarize(runs)
    assert s["ptb x"]["best_baseline"] == "gptq"
    assert abs(s["ptb x"]["reduction"] - (1 - 2.718281828 ** (3.95 - 4.05))) < 1e-6
    assert s["ptb x"]["meets_5pct"] and s["ptb x"]["paired_vs_best"]["windows_better"] == 2
    assert s["other x"]["reduction"] < 0 and not s["other x"]["meets_5pct"]


def test_choices_are_counted_from_the_runs_layer_records(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    samples = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(1))
    spec = QuantSpec.build("int", 4, 4, 4, None, kv_group_size=16)
    result = hessian.quantize_model(model, spec, samples, HessianParams(1, 32), tmp_path)
    s = choices_summary(tmp_path)
    assert s["layers"] == 2
    assert sum(s["sites"]["down_in"]["transform"].values()) == 2
    assert s["linears"]["q_proj"]["rounding"] == dict(
        Counter(lc.linears["q_proj"].rounding for lc in result.choices))
    assert all(-1e-9 <= c <= 1 for c in s["linears"]["o_proj"]["error_cut"])


def test_correlations_rank_units_and_report_the_gain_of_weighting() -> None:
    rows = [{"unit": f"layers.{i}.q_proj", "kl": float(i + 1), "nll_delta": float(i),
             "output_mse": float(5 - i), "weighted_error": 2.0 * (i + 1)} for i in range(5)]
    rows += [{"unit": f"layers.{i}.kv", "kl": 1.0 + i, "nll_delta": 0.1 * i,
              "output_mse": 1.0 + i, "weighted_error": 2.0 + 2 * i} for i in range(3)]
    c = correlations(rows)
    assert c["q_proj"]["mse_vs_kl"] == -1.0 and c["q_proj"]["weighted_vs_kl"] == 1.0
    assert c["q_proj"]["gain_kl"] == 2.0 and c["q_proj"]["meets_0.3"]
    assert c["kv"]["gain_kl"] == 0.0 and not c["kv"]["meets_0.3"]
    assert c["all"]["units"] == 8 and c["all"]["half_weighted_over_kl_median"] == 1.0
