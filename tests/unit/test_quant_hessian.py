"""The hessian method on tiny random Llamas: the sensitivity estimate against finite differences
of the final KL, each choice lowering the objective, a run resumed after an interruption ending
where an uninterrupted one does, and the scales it fixes written by export."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from loadwise.quant import hessian, llama
from loadwise.quant.catalog import HessianParams, QuantMethod
from loadwise.quant.fisher import output_fisher
from loadwise.quant.formats import QuantFormat
from loadwise.quant.sim import simulate
from loadwise.quant.spec import QuantSpec


def tiny_llama(vocab: int, layers: int, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # outlier channels and sharp distributions, as in trained models
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.2, 3.0)
            layer.post_attention_layernorm.weight.uniform_(0.2, 3.0)
            layer.mlp.down_proj.weight.mul_(torch.rand(128) * 4)
        model.lm_head.weight.mul_(8.0)
    return model


def summed_kl(model: Any, ids: torch.Tensor, ref: torch.Tensor) -> float:
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, use_cache=False).logits[0].double(), -1)
    return float((ref.exp() * (ref - logp)).sum())


@pytest.mark.parametrize("name", ["layers.0.v_proj", "layers.1.gate_proj"])
def test_the_sensitivity_estimate_matches_finite_differences_of_the_final_kl(name: str) -> None:
    model = tiny_llama(vocab=48, layers=2, seed=3)
    ids = torch.randint(0, 48, (1, 6), generator=torch.Generator().manual_seed(4))
    est = output_fisher(model, ids, draws=2000, seed=1, dtype=torch.float32)[name]
    with torch.no_grad():
        ref = torch.log_softmax(model(ids, use_cache=False).logits[0].double(), -1)
    lin = dict(llama.all_linears(model))[name]
    eps = 1e-2
    fd, mc = [], []
    for t, j in ((0, 1), (2, 5), (4, 9), (5, 3)):
        kl = []
        for sign in (1.0, -1.0):
            def nudge(_: Any, __: Any, out: torch.Tensor, s: float = sign, t: int = t,
                      j: int = j) -> torch.Tensor:
                out = out.clone()
                out[0, t, j] += s * eps
                return out
            handle = lin.register_forward_hook(nudge)
            kl.append(summed_kl(model, ids, ref))
            handle.remove()
        fd.append(sum(kl) / eps ** 2)  # KL(±ε) ≈ ½ G ε²
        mc.append(float(est[t, j]))
    fd_t, mc_t = torch.tensor(fd), torch.tensor(mc)
    assert fd_t.max() > 3 * fd_t.min()  # the elements differ: a constant estimate fails below
    assert torch.allclose(mc_t, fd_t, rtol=0.2), (mc, fd)


SPEC = QuantSpec.build("int", 4, 4, 4, None, kv_group_size=16)


@pytest.fixture(scope="module")
def run() -> tuple[Any, Any, hessian.Result]:
    model = tiny_llama(vocab=256, layers=2, seed=0)
    samples = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    quantized = copy.deepcopy(model)
    result = hessian.quantize_model(quantized, SPEC, samples, HessianParams(2, 64))
    return model, quantized, result


def test_no_choice_raises_the_objective_and_each_kind_of_choice_lowers_it(
        run: tuple[Any, Any, hessian.Result]) -> None:
    _, _, result = run
    sites = [s for layer in result.choices for s in layer.sites.values()]
    lins = [c for layer in result.choices for c in layer.linears.values()]
    # Each of the three kinds of choice paid somewhere on this model (on the inputs it was made
    # on; that no choice raises the objective holds by construction and is not tested here).
    assert any(s.transform != "none" and s.transform_error < s.start_error for s in sites)
    assert any(s.act_clip < 1.0 for s in sites) or any(c.w_clip < 1.0 for c in lins)
    assert any(c.rounding == "gptq" for c in lins)


def test_the_quantized_model_lands_on_the_grid_and_beats_round_to_nearest_on_the_kl(
        run: tuple[Any, Any, hessian.Result]) -> None:
    from loadwise.quant import methods

    model, quantized, result = run
    for name, lin in llama.all_linears(quantized):
        scale = result.prepared.weight_scales[name]  # int4 per channel: q / scale on the grid
        q = lin.weight / scale
        assert torch.allclose(q, q.round(), atol=1e-3) and q.abs().max() <= 8
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = torch.log_softmax(model(ids, use_cache=False).logits[0].double(), -1)
    ours = summed_kl(simulate(copy.deepcopy(quantized), SPEC, result.prepared), ids, ref)
    rtn = summed_kl(methods.apply(copy.deepcopy(model), QuantMethod("rtn"), SPEC), ids, ref)
    assert ours < rtn


def test_the_choices_lower_the_final_kl_on_text_they_were_not_made_on(
        run: tuple[Any, Any, hessian.Result]) -> None:
    """End to end, on held-out ids: the method with its ranges, smoothing and rotation offered
    beats the same method offered none of them (full ranges, no SmoothQuant alphas, no
    rotation): the local choices add up in the model's output."""
    model, quantized, result = run
    samples = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    bare_cfg = HessianParams(2, 64, w_clips=(1.0,), a_clips=(1.0,), kv_clips=(1.0,), alphas=(),
                             rotate=False)
    bare = copy.deepcopy(model)
    bare_result = hessian.quantize_model(bare, SPEC, samples, bare_cfg)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ref = torch.log_softmax(model(ids, use_cache=False).logits[0].double(), -1)
    full_kl = summed_kl(simulate(copy.deepcopy(quantized), SPEC, result.prepared), ids, ref)
    bare_kl = summed_kl(simulate(bare, SPEC, bare_result.prepared), ids, ref)
    assert full_kl < bare_kl, (full_kl, bare_kl)


class _Interrupt(Exception):
    pass


def test_an_interrupted_run_resumes_and_ends_where_an_uninterrupted_one_does(
        run: tuple[Any, Any, hessian.Result], tmp_path: Path) -> None:
    model, quantized, result = run
    samples = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))

    def stop_after_first(what: str, i: int, n: int) -> None:
        if what == "hessian layers" and i == 1:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        hessian.quantize_model(copy.deepcopy(model), SPEC, samples, HessianParams(2, 64),
                               tmp_path, stop_after_first)
    assert (tmp_path / "layer-000.pt").exists() and not (tmp_path / "layer-001.pt").exists()
    resumed = copy.deepcopy(model)
    again = hessian.quantize_model(resumed, SPEC, samples, HessianParams(2, 64), tmp_path)
    assert again.resumed_layers == 1
    for (_, a), (_, b) in zip(llama.all_linears(resumed), llama.all_linears(quantized),
                              strict=True):
        assert torch.equal(a.weight, b.weight)
    assert again.prepared.act_clip == result.prepared.act_clip
    assert [c.to_json() for c in again.choices] == [c.to_json() for c in result.choices]
    # A finished run is read back whole.
    third = hessian.quantize_model(copy.deepcopy(model), SPEC, samples, HessianParams(2, 64),
                                   tmp_path)
    assert third.resumed_layers == 2


def test_gptq_with_a_clipped_range_reports_the_scales_it_rounded_to() -> None:
    from loadwise.quant.weights import gptq_matrix

    torch.manual_seed(5)
    x = torch.randn(256, 64) @ torch.randn(64, 64)
    w = torch.randn(16, 64)
    fmt = QuantFormat("int", 4, 16)
    q, scale = gptq_matrix(w, 2 * x.T @ x / 256, fmt, clip=0.8)
    assert scale.shape == (16, 4)
    k = q.reshape(16, 4, 16) / scale[:, :, None]
    assert torch.allclose(k, k.round(), atol=1e-4)
    assert k.round().min() >= -8 and k.round().max() <= 7
    full = gptq_matrix(w, 2 * x.T @ x / 256, fmt)[1]
    assert torch.all(scale < full)  # the clip shrank every group's range


def test_half_the_weighted_error_predicts_the_kl_when_errors_are_small() -> None:
    """At int8 each unit's error is small: ½ Σ F ΔY² (second order) is the summed KL it
    causes; the plain MSE is not proportional to it across units."""
    from loadwise.quant.sensitivity import study, units

    model = tiny_llama(vocab=48, layers=2, seed=3)
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(4))
    fisher = output_fisher(model, ids, draws=400, seed=2, dtype=torch.float32)
    spec = QuantSpec.build("int", 8, 8, 8, None, kv_group_size=16)
    rows = study(model, spec, ids, fisher, units(model))
    assert len(rows) == 2 * 7 + 2
    ratios = torch.tensor([r.kl / (r.weighted_error / 2) for r in rows])
    assert ratios.median() == pytest.approx(1.0, rel=0.25), ratios
    mse_ratios = torch.tensor([r.kl / r.output_mse for r in rows])
    assert mse_ratios.max() > 10 * mse_ratios.min()


def test_the_progress_line_shows_a_bar_and_the_time_left_from_the_rate_so_far(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from loadwise.cli import quant as cli_quant

    clock = iter([100.0, 110.0, 130.0, 135.0])
    monkeypatch.setattr(cli_quant.time, "monotonic", lambda: next(clock))
    shown: list[str] = []
    update = cli_quant.eta_progress(shown.append)
    update("hessian layers", 0, 30)
    update("hessian layers", 1, 30)  # 10 s per layer so far: 29 left
    update("hessian layers", 3, 30)  # 30 s for 3 layers: 27 left
    update("sensitivity", 0, 1)  # another step has its own clock
    assert shown[0] == "hessian layers [....................] 0/30"
    assert shown[1].endswith("1/30, about 290 s left")
    assert shown[2] == "hessian layers [##..................] 3/30, about 270 s left"
    assert shown[3].startswith("sensitivity [") and "left" not in shown[3]


def test_records_written_before_methods_carried_their_parameters_still_read() -> None:
    """Committed results name the method, with SmoothQuant's alpha and the hessian config
    beside it (the earliest without a hessian field): each reads back as the method with
    those parameters, and writes and reads back unchanged."""
    import json

    from loadwise.quant.catalog import SmoothQuantParams
    from loadwise.quant.run import EvalRecord

    results = Path(__file__).parents[2] / "benchmarks/results"
    runs = json.loads((results / "quant-ppl-20261206-102753.json").read_text())["runs"]
    assert "hessian" not in runs[2]["config"]
    assert EvalRecord.from_json(runs[2]).config.method == QuantMethod("rtn")
    smooth = next(r for r in runs if r["config"]["method"] == "smoothquant")
    rec = EvalRecord.from_json(smooth)
    assert rec.config.method.params == SmoothQuantParams(smooth["config"]["alpha"])
    hess = json.loads((results / "quant-hessian-20261206-125749.json").read_text())["runs"]
    row = next(r for r in hess if r["config"]["method"] == "hessian")
    assert isinstance(EvalRecord.from_json(row).config.method.params, HessianParams)
    for r in (runs[2], smooth, row):
        rec = EvalRecord.from_json(r)
        assert EvalRecord.from_json(rec.to_json()) == rec
        assert rec.to_json()["config"]["method"] == r["config"]["method"]
