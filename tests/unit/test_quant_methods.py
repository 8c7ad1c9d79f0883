"""The methods on a tiny random Llama (and the embedded model's weights where a test says so):
every transform keeps the function the model computes, each solver does what it claims on its
own objective, and `loadwise quant eval` runs end to end and writes its record."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from loadwise.errors import LoadwiseError
from loadwise.quant import formats, llama, methods, rotation, smoothing, weights
from loadwise.quant.catalog import MethodError, QuantMethod
from loadwise.quant.formats import QuantFormat
from loadwise.quant.sim import Prepared, simulate
from loadwise.quant.spec import QuantSpec

VOCAB = 512


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms and columns far from uniform, as in trained models
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.2, 3.0)
            layer.post_attention_layernorm.weight.uniform_(0.2, 3.0)
            layer.mlp.down_proj.weight.mul_(torch.rand(128) * 4)
    if model.lm_head.weight is model.model.embed_tokens.weight:
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())
    return model


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


IDS = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(1))
CALIB = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("transform", ["dualquant", "smoothquant", "rotation"])
def test_each_transform_keeps_the_models_function(tiny: torch.nn.Module, transform: str) -> None:
    ref = logits(tiny, IDS)
    m = copy.deepcopy(tiny)
    rotate_in = {}
    if transform == "dualquant":
        smoothing.dualquant(m, QuantFormat("int"))
    elif transform == "smoothquant":
        smoothing.smoothquant(m, smoothing.activation_absmax(m, CALIB), 0.5)
    else:
        rotate_in = rotation.rotate(m, seed=3)
    out = logits(simulate(m, QuantSpec(None), Prepared(rotate_in=rotate_in)), IDS)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    # ...and the transform did change the weights (a no-op would pass the check above).
    changed = [not torch.equal(a.weight, b.weight)
               for (_, a), (_, b) in zip(llama.all_linears(m), llama.all_linears(tiny),
                                         strict=True)]
    assert any(changed)


def test_a_wrong_fold_is_caught_by_the_equivalence_check(tiny: torch.nn.Module) -> None:
    m = copy.deepcopy(tiny)
    s = torch.linspace(0.5, 2.0, 128)
    with torch.no_grad():  # scale down_proj's columns without up_proj's rows: not a fold
        m.model.layers[0].mlp.down_proj.weight.mul_(s[None, :])
    assert not torch.allclose(logits(m, IDS), logits(tiny, IDS), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["int4-channel", "int4-g16", "mxfp4", "nvfp4"])
def test_dualquant_scales_never_reconstruct_worse_than_no_scales(name: str) -> None:
    torch.manual_seed(4)
    w = torch.randn(48, 64) * (torch.rand(64) * 5)[None, :]
    fmt = QuantFormat.parse(name)
    s = smoothing.dualquant_scales(w, fmt)
    assert smoothing.reconstruction_error(w, s, fmt) <= \
        smoothing.reconstruction_error(w, torch.ones(64), fmt)
    assert smoothing.reconstruction_error(w, s, fmt) < \
        smoothing.reconstruction_error(w, torch.ones(64), fmt) * 0.99 or name == "nvfp4"


@pytest.mark.parametrize("name", ["int4-channel", "int4-g16", "mxfp4"])
def test_gptq_has_lower_output_error_than_rounding(name: str) -> None:
    torch.manual_seed(5)
    x = torch.randn(512, 64) @ torch.randn(64, 64)  # correlated inputs: where GPTQ pays
    w = torch.randn(32, 64)
    fmt = QuantFormat.parse(name)
    q, _ = weights.gptq_matrix(w, 2 * x.T @ x / x.shape[0], fmt)
    r = formats.quantize(w, fmt)
    if fmt.kind == "int" and fmt.group is None:  # every row on a 16-value grid
        assert all(len(torch.unique(row)) <= 16 for row in q)
    assert ((x @ (q - w).T) ** 2).sum() < ((x @ (r - w).T) ** 2).sum()


def test_gptq_over_the_model_quantizes_every_linear(tiny: torch.nn.Module) -> None:
    m = copy.deepcopy(tiny)
    fmt = QuantFormat.parse("int4-channel")
    weights.gptq(m, fmt, CALIB)
    for _, lin in llama.all_linears(m):
        assert len(torch.unique(lin.weight[0])) <= 16


def test_methods_refuse_what_they_cannot_do(tiny: torch.nn.Module) -> None:
    with pytest.raises(MethodError, match="unknown method"):
        QuantMethod("awq")
    with pytest.raises(MethodError, match="calibration"):
        methods.apply(copy.deepcopy(tiny), QuantMethod("gptq"), QuantSpec.build("int", 4, 16, 16,
                                                                                 None))
    with pytest.raises(MethodError, match="w-bits"):
        methods.apply(copy.deepcopy(tiny), QuantMethod("dualquant"),
                      QuantSpec.build("int", 16, 4, 16, None))


@pytest.mark.parametrize("name", ["fp32", "rtn", "smoothquant", "gptq", "rotation", "dualquant",
                                  "hessian"])
def test_what_the_registry_says_of_a_method_is_what_it_does(tiny: torch.nn.Module,
                                                            name: str) -> None:
    """Each method registered runs, or refuses, as its entry says: without calibration text
    only where it does not calibrate; without a weight format only where it does not solve for
    one; the reference leaves the weights alone; a method that rounds the weights itself
    returns their scales."""
    from loadwise.quant.calibration import Calibration
    from loadwise.quant.catalog import METHODS, method

    assert name in METHODS
    m = method(name)
    given = {"hessian": {"segments": 2, "tokens": 32, "fisher_draws": 1},
             "smoothquant": {"alpha": 0.5}}
    cfg = QuantMethod.build(name, **given.get(name, {}))
    w4 = QuantSpec.build("int", 4, 16, 16, None)
    if m.calibrates:
        with pytest.raises(MethodError, match="calibration"):
            methods.prepare(copy.deepcopy(tiny), cfg, w4)
    if m.solves_weights:
        with pytest.raises(MethodError, match="w-bits"):
            methods.prepare(copy.deepcopy(tiny), cfg, QuantSpec.build("int", 16, 4, 16, None),
                            Calibration(lambda: CALIB))
    model = copy.deepcopy(tiny)
    prepared = methods.prepare(model, cfg, w4, Calibration(lambda: CALIB))
    changed = any(not torch.equal(a.weight, b.weight) for (_, a), (_, b) in
                  zip(llama.all_linears(model), llama.all_linears(tiny), strict=True))
    assert changed == m.quantizes
    assert bool(prepared.weight_scales) == m.rounds_weights
    with pytest.raises(LoadwiseError, match="unknown method 'awq'"):
        method("awq")


def test_kv_quantization_changes_only_k_and_v_outputs(tiny: torch.nn.Module) -> None:
    spec = QuantSpec.build("int", 16, 16, 2, None, kv_group_size=16)
    m = simulate(copy.deepcopy(tiny), spec)
    attn = m.model.layers[0].self_attn
    assert attn.k_proj.out == spec.kv and attn.v_proj.out == spec.kv and attn.q_proj.out is None
    assert not torch.allclose(logits(m, IDS), logits(tiny, IDS))


def test_embedded_q4_1_weights_survive_an_asymmetric_grid_over_groups_of_32() -> None:
    """The embedded model's linears are GGUF Q4_1 dequantized: a 4-bit min-max grid over the
    same aligned groups of 32 reproduces them exactly, per channel it does not."""
    from loadwise.model import default_model_dir, verify

    model_dir = default_model_dir()
    if verify(model_dir) is not None:
        pytest.skip("the embedded model is not prepared (loadwise model prepare)")
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    name = "model.layers.3.mlp.down_proj.weight"
    w = tensors[name]
    assert torch.equal(formats.quantize(w, QuantFormat.parse("int4-g32-asym")), w)
    assert not torch.equal(formats.quantize(w, QuantFormat.parse("int4-channel-asym")), w)


def tiny_dir(tiny: torch.nn.Module, tmp_path: Path) -> Path:
    """The tiny model saved with the embedded model's tokenizer (its vocabulary resized to it)."""
    from transformers import AutoTokenizer

    from loadwise.model import default_model_dir, verify

    if verify(default_model_dir()) is not None:
        pytest.skip("needs the embedded model's tokenizer (loadwise model prepare)")
    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    model_dir = tmp_path / "tiny"
    model = copy.deepcopy(tiny)
    model.resize_token_embeddings(len(tok))
    model.config.tie_word_embeddings = False
    # Its own lm_head on disk: a missing one would be initialized anew at every load.
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir


@pytest.mark.parametrize("method", ["gptq", "hessian"])
def test_quant_eval_end_to_end_writes_its_record(tiny: torch.nn.Module, tmp_path: Path,
                                                 method: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from loadwise.cli import main

    model_dir = tiny_dir(tiny, tmp_path)
    monkeypatch.setenv("LOADWISE_HOME", str(tmp_path / "home"))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 600))
    out = tmp_path / "rec.json"
    argv = ["quant", "eval", "--model", str(model_dir), "--method", method, "--format", "int",
            "--group-size", "16", "--kv-bits", "4", "--text", str(text), "--max-windows", "1",
            "--calib-segments", "2", "--out", str(out)]
    if method == "hessian":
        argv += ["--hessian-segments", "2", "--hessian-tokens", "256"]
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    assert rec["machine"]["isa"] and rec["config"]["method"] == method
    assert len(rec["perplexity"]["window_nll"]) == 1 and rec["perplexity"]["ppl"] > 1
    if method == "hessian":  # its finished layers kept: the same command reads them back
        runs = list((tmp_path / "home" / "quant-runs").glob("hessian-*/layer-*.pt"))
        assert len(runs) == 2
        assert main(argv) == 0
        assert json.loads(out.read_text())["perplexity"] == rec["perplexity"]
        assert main([*argv[:-2], "--hessian-tokens", "4096"]) == 2
        assert main([*argv[:-4], "--hessian-segments", "3"]) == 2  # more than --calib-segments
    else:
        assert main([*argv, "--hessian-tokens", "256"]) == 2  # gptq takes no such option


@pytest.mark.parametrize(("scheme", "method"), [("w8a8", "rtn"), ("w4a16", "dualquant"),
                                                ("w8a8", "smoothquant"), ("w4a16", "gptq"),
                                                ("w8a8", "hessian")])
def test_an_export_holds_the_harness_integers_in_compressed_tensors_schema(
        tiny: torch.nn.Module, tmp_path: Path, scheme: str, method: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from loadwise.quant.export import ExportConfig, export, ptb_calibration

    src = tiny_dir(tiny, tmp_path)
    monkeypatch.setenv("LOADWISE_HOME", str(tmp_path / "home"))
    qm = QuantMethod.build(method, segments=2, tokens=256) if method == "hessian" \
        else QuantMethod(method)
    cfg = ExportConfig(scheme, qm, group_size=16)
    out = export(src, tmp_path / "out", cfg)
    config = json.loads((out / "config.json").read_text())
    QuantizationConfig.model_validate(config["quantization_config"])
    tensors = load_file(str(out / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj"
    scale = tensors[f"{key}.weight_scale"].float()
    if scheme == "w8a8":
        q = tensors[f"{key}.weight"]
        assert q.dtype == torch.int8 and config["dtype"] == "float32"
        w = q.float() * scale
    else:
        q = unpack_from_int32(tensors[f"{key}.weight_packed"], 4,
                              torch.Size(tensors[f"{key}.weight_shape"].tolist()))
        assert q.abs().max() <= 8 and config["dtype"] == "bfloat16"
        w = (q.float().reshape(q.shape[0], -1, 16) * scale[:, :, None]).reshape(q.shape)
    # The same integers the harness rounds to, from the same (transformed) float weights.
    ref = llama.load(src)
    if method == "dualquant":
        smoothing.dualquant(ref, cfg.weight_format)
    if method in ("gptq", "hessian"):  # rounded by the method: the harness's weights as they are
        methods.prepare(ref, cfg.runnable,
                        QuantSpec(cfg.weight_format, cfg.activation_format), ptb_calibration(src))
        got = ref.model.layers[1].mlp.down_proj.weight
        assert torch.allclose(w, got.to(w.dtype).float(), rtol=1e-2, atol=1e-6)
    elif method != "smoothquant":  # smoothquant's scales come from PTB calibration: checked below
        expect = formats.quantize(ref.model.layers[1].mlp.down_proj.weight, cfg.weight_format)
        assert torch.allclose(w, expect.to(w.dtype).float(), rtol=1e-2, atol=1e-6)
    else:
        assert not torch.allclose(tensors["model.layers.1.post_attention_layernorm.weight"],
                                  ref.model.layers[1].post_attention_layernorm.weight)


def test_each_method_owns_its_parameters_and_refuses_another_methods() -> None:
    """A method is built with the parameters it takes, by name; an option it does not take
    is a one-line error naming that option; each round-trips through JSON; the parameters'
    rules hold wherever the method is built."""
    from loadwise.quant.catalog import (
        HESSIAN_SEGMENTS,
        METHODS,
        HessianParams,
        Params,
        SmoothQuantParams,
    )

    assert QuantMethod.build("smoothquant", alpha=0.6).params == SmoothQuantParams(0.6)
    assert QuantMethod.build("smoothquant", segments=None).params == SmoothQuantParams(None)
    assert QuantMethod.build("hessian", tokens=256).params == HessianParams(HESSIAN_SEGMENTS, 256)
    assert QuantMethod.build("rtn").params == Params()
    with pytest.raises(MethodError, match="--method rtn does not take --alpha"):
        QuantMethod.build("rtn", alpha=0.5)
    with pytest.raises(MethodError, match="--method smoothquant does not take --hessian-tokens"):
        QuantMethod.build("smoothquant", tokens=256)
    with pytest.raises(MethodError, match="alpha is in"):
        QuantMethod.build("smoothquant", alpha=1.5)
    with pytest.raises(MethodError, match="--hessian-tokens must be 1 to 2048"):
        QuantMethod.build("hessian", tokens=4096)
    with pytest.raises(MethodError, match="takes SmoothQuantParams"):
        QuantMethod("smoothquant", HessianParams())
    assert QuantMethod("hessian").params == HessianParams()
    for name in METHODS:
        qm = QuantMethod(name)
        assert QuantMethod.from_json(qm.to_json()) == qm
        assert hash(qm) == hash(QuantMethod.from_json(qm.to_json()))


def test_an_export_runs_each_method_as_vllm_can() -> None:
    """SmoothQuant's alpha where none is given is the export's; the hessian method exports
    without its online rotation and with activations at full range (vLLM quantizes them per
    token from their max); hessian segments beyond the calibration set are refused."""
    from loadwise.quant.catalog import CALIB_SEGMENTS, EXPORT_ALPHA, HessianParams
    from loadwise.quant.export import ExportConfig, ExportError

    assert ExportConfig("w8a8", QuantMethod("smoothquant")).runnable.params.alpha == EXPORT_ALPHA
    given = ExportConfig("w8a8", QuantMethod.build("smoothquant", alpha=0.7))
    assert given.runnable == given.method
    hess = ExportConfig("w8a8", QuantMethod.build("hessian", segments=2)).runnable.params
    assert isinstance(hess, HessianParams)
    assert (hess.segments, hess.rotate, hess.clip_activations) == (2, False, False)
    with pytest.raises(ExportError, match="export supports"):
        ExportConfig("w8a8", QuantMethod("rotation"))
    with pytest.raises(ExportError, match="calibration segments"):
        ExportConfig("w8a8", QuantMethod.build("hessian", segments=CALIB_SEGMENTS + 1))
