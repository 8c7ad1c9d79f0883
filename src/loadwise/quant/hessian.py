"""Hessian-guided post-training quantization: range, transform and rounding chosen under one
objective, how much quantization changes the model's final output.

The objective at a linear is its output error weighted by the output's sensitivity,
``E = Σ_t Σ_j F[t, j] · (Ŷ[t, j] − Y[t, j])²``, F the diagonal Gauss-Newton (Fisher) estimate
of the final KL's curvature with respect to that output (``fisher.output_fisher``): a second-
order estimate of the KL the error causes at the model's output, were it the only error.

Layer by layer (inputs from the layers before as already quantized), at each of the four input
sites (attn_in, o_in, mlp_in, down_in), summed over the site's consumers:

1. **transform**: the site's scales (none, SmoothQuant's for each α, DualQuant's) and, at
   down_in, an online rotation on top; chosen with round-to-nearest weights and full ranges;
2. **activation range**: the input's per-token clip ratio;
3. **weight range**: each consumer's clip ratio;
4. **rounding**: GPTQ with the sensitivity-weighted Hessian ``2/n Σ_t f_t x_t x_tᵀ``
   (``f_t`` the token's mean sensitivity) against round-to-nearest;
5. **KV range** (after attn_in): k_proj's and v_proj's output clip ratios.

Each step keeps the incumbent unless a candidate lowers E, and every step's grid holds the
starting point (no transform, full ranges, round-to-nearest), so no layer ends with a higher E
than it started with. After each layer the run saves its state: an interrupted run resumes at
the next layer.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from loadwise.quant import formats, smoothing
from loadwise.quant.catalog import HessianParams
from loadwise.quant.fisher import output_fisher
from loadwise.quant.formats import QuantFormat, fit, grouped
from loadwise.quant.llama import (
    CONSUMERS,
    INPUTS,
    KV_LINEARS,
    Shape,
    consumer_weight,
    consumers,
    fold_scales,
    layers,
    linears,
    o_in_to_kv,
    per_kv_channel_max,
    set_linear,
)
from loadwise.quant.rotation import random_orthogonal
from loadwise.quant.sim import Prepared, SimLinear
from loadwise.quant.spec import QuantSpec
from loadwise.quant.weights import gptq_matrix, layer_inputs


def run_dir(params: HessianParams, root: Path, spec: QuantSpec, model_dir: Path,
            calib_segments: int, calib_tokens: int, calib_seed: int) -> Path:
    """Where a run with ``params`` on ``model_dir`` keeps its finished layers: the same command
    run again resumes it (or reads a finished run back). ``calib_*``: the PTB train
    calibration set it solved on."""
    calibration = f"ptb-train:{calib_segments}x{calib_tokens}:{calib_seed}"
    files = [[p.name, p.stat().st_size, p.stat().st_mtime_ns]
             for p in sorted(model_dir.glob("*.safetensors"))]
    blob = json.dumps({"cfg": asdict(params), "spec": spec.to_json(), "calibration": calibration,
                       "model": [str(model_dir.resolve()), files]}, sort_keys=True)
    return root / f"hessian-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


@dataclass
class SiteChoice:
    transform: str = "none"  # none | smoothquant:<α> | dualquant
    rotated: bool = False
    act_clip: float = 1.0
    # E summed over the consumers, round-to-nearest weights, full ranges, on the float layer's
    # inputs: with no transform, and with the chosen one.
    start_error: float = 0.0
    transform_error: float = 0.0
    # On the inputs the quantized layers before produce: the chosen transform at full ranges
    # with round-to-nearest, and after every choice.
    range_start_error: float = 0.0
    error: float = 0.0


@dataclass
class LinearChoice:
    w_clip: float = 1.0
    rounding: str = "rtn"  # rtn | gptq
    out_clip: float = 1.0  # k_proj / v_proj: the KV cache's range
    start_error: float = 0.0  # the site's transform, full ranges, round-to-nearest
    error: float = 0.0


@dataclass
class LayerChoices:
    sites: dict[str, SiteChoice] = field(default_factory=dict)
    linears: dict[str, LinearChoice] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"sites": {k: asdict(v) for k, v in self.sites.items()},
                "linears": {k: asdict(v) for k, v in self.linears.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LayerChoices:
        return cls({k: SiteChoice(**v) for k, v in d["sites"].items()},
                   {k: LinearChoice(**v) for k, v in d["linears"].items()})


@dataclass
class LayerResult:
    choices: LayerChoices
    rotations: dict[str, torch.Tensor]  # online input rotations by short name
    scales: dict[str, torch.Tensor]  # weight scales [rows, groups] by short name
    outputs: list[torch.Tensor]  # the layer's outputs as simulated: the next layer's inputs


@dataclass
class Result:
    prepared: Prepared
    choices: list[LayerChoices]
    resumed_layers: int  # layers read back from an earlier run


def read_choices(workdir: Path) -> list[LayerChoices]:
    """What a run in ``workdir`` chose for each layer it finished."""
    out = []
    for path in sorted(workdir.glob("layer-*.pt")):
        out.append(LayerChoices.from_json(torch.load(path, weights_only=False)["choices"]))
    return out


def weighted_error(y_hat: torch.Tensor, y: torch.Tensor, f: torch.Tensor) -> float:
    """Σ f · (ŷ − y)², ``f`` the sensitivity of each output (same shape)."""
    return float((f * (y_hat - y) ** 2).sum())


def rtn_weight(w: torch.Tensor, fmt: QuantFormat | None, clip: float = 1.0) -> torch.Tensor:
    return formats.quantize(w, fmt, clip) if fmt else w


def weight_scales(w: torch.Tensor, fmt: QuantFormat, clip: float) -> torch.Tensor:
    """Round-to-nearest's scales ``[rows, groups]`` (whole groups: what export writes)."""
    return fit(grouped(w.float(), fmt.group), fmt, clip=clip).scale.squeeze(-1)


class _Site:
    """One input site of a layer: its input X (as it arrives, before the site's transform), its
    consumers and their sensitivities; evaluates E for a transform and ranges."""

    def __init__(self, layer: Any, site: str, x: torch.Tensor, fisher: dict[str, torch.Tensor],
                 spec: QuantSpec, shape: Shape) -> None:
        self.layer, self.site, self.spec, self.shape = layer, site, spec, shape
        self.x = x
        self.names = CONSUMERS[site]
        self.fisher = {n: fisher[n].float() for n in self.names}
        self.targets = {n: x @ linears(layer)[n].weight.detach().T for n in self.names}

    def column_scales(self, s: torch.Tensor) -> torch.Tensor:
        return s[o_in_to_kv(self.shape)] if self.site == "o_in" else s

    def inputs(self, s: torch.Tensor | None, rotate: torch.Tensor | None,
               act_clip: float) -> torch.Tensor:
        x = self.x if s is None else self.x / self.column_scales(s)[None, :]
        if rotate is not None:
            x = x @ rotate
        return formats.quantize(x, self.spec.activations, act_clip)

    def weight(self, name: str, s: torch.Tensor | None,
               rotate: torch.Tensor | None) -> torch.Tensor:
        w = linears(self.layer)[name].weight.detach()
        if s is not None:
            w = w * self.column_scales(s)[None, :]
        return w @ rotate if rotate is not None else w

    def output(self, name: str, y: torch.Tensor, out_clip: float = 1.0) -> torch.Tensor:
        """A consumer's output as the model keeps it (k_proj, v_proj: in the KV cache)."""
        return formats.quantize(y, self.spec.kv, out_clip) if name in KV_LINEARS else y

    def error_of(self, name: str, xq: torch.Tensor, wq: torch.Tensor,
                 out_clip: float = 1.0) -> float:
        return weighted_error(self.output(name, xq @ wq.T, out_clip), self.targets[name],
                              self.fisher[name])

    def error(self, s: torch.Tensor | None, rotate: torch.Tensor | None,
              act_clip: float) -> dict[str, float]:
        """E per consumer with round-to-nearest weights and full weight and KV ranges."""
        xq = self.inputs(s, rotate, act_clip)
        return {n: self.error_of(n, xq, rtn_weight(self.weight(n, s, rotate), self.spec.weights))
                for n in self.names}


def _transforms(site: _Site, cfg: HessianParams) -> dict[str, torch.Tensor | None]:
    w = consumer_weight(site.layer, site.site, site.shape)
    amax = site.x.abs().amax(dim=0)
    if site.site == "o_in":
        amax = per_kv_channel_max(site.shape, amax)
    out: dict[str, torch.Tensor | None] = {"none": None}
    for a in cfg.alphas:
        out[f"smoothquant:{a:g}"] = smoothing.smoothquant_scales(amax, w, a)
    if site.spec.weights is not None:
        out["dualquant"] = smoothing.dualquant_scales(w, site.spec.weights)
    return out


def _capture(layer: Any, site: str, inputs: list[torch.Tensor],
             kwargs: dict[str, Any]) -> torch.Tensor:
    """The site's input (before any online rotation) over all segments, ``[tokens, channels]``."""
    got: list[torch.Tensor] = []

    def grab(_: Any, args: tuple[torch.Tensor, ...]) -> None:
        got.append(args[0].reshape(-1, args[0].shape[-1]).detach().float())
    handle = consumers(layer, site)[0].register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            for x in inputs:
                layer(x, **kwargs)
    finally:
        handle.remove()
    return torch.cat(got)


def _choose_transforms(layer: Any, inputs: list[torch.Tensor], kwargs: dict[str, Any],
                       fisher: dict[str, torch.Tensor], spec: QuantSpec, cfg: HessianParams,
                       shape: Shape, choices: LayerChoices,
                       rotation: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Each site's transform (scales, and for down_proj's input an online rotation), chosen on
    the float layer and folded in; ``fisher`` rescaled in place where a producer's outputs are
    divided by the scales. Each site's input is captured once: the folds keep the function, so
    a site's input under its own scales is x / s. Returns the online rotations."""
    rotations: dict[str, torch.Tensor] = {}
    for site_name in INPUTS:
        site = _Site(layer, site_name, _capture(layer, site_name, inputs, kwargs), fisher, spec,
                     shape)
        start = sum(site.error(None, None, 1.0).values())
        best_name, best_s, best_rot, best = "none", None, False, start
        options = _transforms(site, cfg)
        for name, s in options.items():
            if s is None:
                continue  # "none": scored above as the start
            e = sum(site.error(s, None, 1.0).values())
            if e < best:
                best_name, best_s, best = name, s, e
        if site_name == "down_in" and rotation is not None:
            for name in dict.fromkeys(("none", best_name)):  # in a fixed order
                e = sum(site.error(options[name], rotation, 1.0).values())
                if e < best:
                    best_name, best_s, best_rot, best = name, options[name], True, e
        choices.sites[site_name] = SiteChoice(best_name, best_rot, start_error=start,
                                              transform_error=best)
        if best_s is not None:
            fold_scales(layer, site_name, best_s, shape)
            # The producer's output channels are divided by s: their sensitivity scales by s².
            if site_name == "o_in":
                fisher["v_proj"] = fisher["v_proj"] * (best_s ** 2)[None, :]
            elif site_name == "down_in":
                fisher["up_proj"] = fisher["up_proj"] * (best_s ** 2)[None, :]
        if best_rot:
            assert rotation is not None
            layer.mlp.down_proj.weight.copy_(layer.mlp.down_proj.weight @ rotation)
            rotations["down_proj"] = rotation

    return rotations


def _choose_ranges_and_rounding(layer: Any, inputs: list[torch.Tensor], kwargs: dict[str, Any],
                                fisher: dict[str, torch.Tensor], spec: QuantSpec,
                                cfg: HessianParams, shape: Shape, choices: LayerChoices,
                                rotations: dict[str, torch.Tensor],
                                originals: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Ranges and rounding, site by site, on the inputs the quantized consumers before produce
    (down_proj's input rotated here: its weight already holds the rotation); each linear is
    replaced by its simulated quantized form as it is done. Returns the weights' scales."""
    scales: dict[str, torch.Tensor] = {}
    for site_name in INPUTS:
        rot = rotations.get("down_proj") if site_name == "down_in" else None
        x = _capture(layer, site_name, inputs, kwargs)
        site = _Site(layer, site_name, x if rot is None else x @ rot, fisher, spec, shape)
        choice = choices.sites[site_name]
        per = site.error(None, None, 1.0)
        choice.range_start_error = best = sum(per.values())
        if spec.activations is not None and cfg.clip_activations:
            for c in cfg.a_clips[1:]:
                e = sum(site.error(None, None, c).values())
                if e < best:
                    choice.act_clip, best = c, e
        xq = site.inputs(None, None, choice.act_clip)
        for n in site.names:
            lc = choices.linears[n] = LinearChoice(start_error=per[n])
            w = site.weight(n, None, None)
            w_best = rtn_weight(w, spec.weights)
            e_best = site.error_of(n, xq, w_best)
            if spec.weights is not None:
                for c in cfg.w_clips[1:]:
                    wq = rtn_weight(w, spec.weights, c)
                    e = site.error_of(n, xq, wq)
                    if e < e_best:
                        w_best, lc.w_clip, e_best = wq, c, e
                whole = spec.weights.group is None or w.shape[1] % spec.weights.group == 0
                scale = weight_scales(w, spec.weights, lc.w_clip) if whole else None
                ft = site.fisher[n].mean(dim=1)
                hessian = (xq * ft[:, None]).T @ xq * (2.0 / max(len(ft), 1))
                wg, gscale = gptq_matrix(w, hessian, spec.weights, clip=lc.w_clip)
                e = site.error_of(n, xq, wg)
                if e < e_best:
                    w_best, e_best, lc.rounding, scale = wg, e, "gptq", gscale
                if scale is not None:
                    scales[n] = scale
            if n in KV_LINEARS and spec.kv is not None:
                for c in cfg.kv_clips[1:]:
                    e = site.error_of(n, xq, w_best, c)
                    if e < e_best:
                        lc.out_clip, e_best = c, e
            lc.error = e_best
            originals[n].weight.copy_(w_best)
        choice.error = sum(choices.linears[n].error for n in site.names)
        for n in site.names:
            kv = spec.kv if n in KV_LINEARS else None
            set_linear(layer, n, SimLinear(originals[n], spec.activations, kv, rot,
                                            choice.act_clip, choices.linears[n].out_clip))
    return scales


@torch.no_grad()
def quantize_layer(layer: Any, index: int, inputs: list[torch.Tensor], kwargs: dict[str, Any],
                   fisher: dict[str, torch.Tensor], spec: QuantSpec, cfg: HessianParams,
                   shape: Shape) -> LayerResult:
    """Quantize one decoder layer in place. ``fisher``: its linears' sensitivities by short
    name (``v_proj``), ``[tokens, out]``."""
    choices = LayerChoices()
    fisher = dict(fisher)  # the transforms rescale the producers' sensitivities in this copy
    originals = dict(linears(layer))
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)
    rotation = random_orthogonal(shape.intermediate, gen) if cfg.rotate else None

    # 1. Transforms, on the float layer.
    rotations = _choose_transforms(layer, inputs, kwargs, fisher, spec, cfg, shape, choices,
                                   rotation)
    # 2-5. Ranges and rounding, site by site.
    scales = _choose_ranges_and_rounding(layer, inputs, kwargs, fisher, spec, cfg, shape,
                                         choices, rotations, originals)
    outputs = [layer(x, **kwargs) for x in inputs]  # as simulated: the next layer's inputs
    for n, lin in originals.items():
        set_linear(layer, n, lin)
    return LayerResult(choices, rotations, scales, outputs)


def _save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _finished(workdir: Path) -> tuple[int, list[torch.Tensor] | None]:
    """How many layers an earlier run finished, and the next layer's inputs. A layer counts
    once its file and the inputs after it are both on disk."""
    saved = workdir / "inputs.pt"
    if not saved.exists():
        return 0, None
    after = torch.load(saved, weights_only=False)
    done = 0
    while done <= after["after_layer"] and (workdir / f"layer-{done:03d}.pt").exists():
        done += 1
    return (done, after["inputs"]) if done == after["after_layer"] + 1 else (0, None)


def quantize_model(model: Any, spec: QuantSpec, samples: torch.Tensor, cfg: HessianParams,
                   workdir: Path | None = None,
                   progress: Callable[[str, int, int], None] | None = None) -> Result:
    """The float32 ``model`` quantized in place, layer by layer. ``samples``: calibration ids
    ``[n, tokens]`` (the first ``cfg.segments`` rows, ``cfg.tokens`` columns are used).
    ``workdir``: where each finished layer is saved; a run given the directory of an
    interrupted one resumes after its last finished layer."""
    if samples.shape[0] < cfg.segments or samples.shape[1] < cfg.tokens:
        raise ValueError(f"the hessian method needs {cfg.segments} calibration segments of "
                         f"{cfg.tokens} tokens, got {tuple(samples.shape)}")
    segs = samples[:cfg.segments, :cfg.tokens]
    shape = Shape.of(model)
    all_layers = layers(model)
    n = len(all_layers)
    inputs, kwargs = layer_inputs(model, segs)
    done, resumed = 0, None
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        done, resumed = _finished(workdir)
    # The sensitivities are the float model's: estimated before any finished layer is loaded.
    fisher = _fisher(model, segs, cfg, progress) if done < n else {}
    records: list[dict[str, Any]] = []
    for i in range(done):
        assert workdir is not None
        rec = torch.load(workdir / f"layer-{i:03d}.pt", weights_only=False)
        all_layers[i].load_state_dict(rec["state"])
        records.append(rec)
    if resumed is not None:
        inputs = resumed
    for i in range(done, n):
        per = {name: fisher.pop(f"layers.{i}.{name}") for name in linears(all_layers[i])}
        out = quantize_layer(all_layers[i], i, inputs, kwargs, per, spec, cfg, shape)
        inputs = out.outputs
        rec = {"state": all_layers[i].state_dict(), "choices": out.choices.to_json(),
               "rotations": out.rotations, "scales": out.scales}
        if workdir is not None:
            _save(rec, workdir / f"layer-{i:03d}.pt")
            _save({"after_layer": i, "inputs": inputs}, workdir / "inputs.pt")
        records.append(rec)
        if progress:
            progress("hessian layers", i + 1, n)
    prepared = Prepared()
    choices = []
    for i, rec in enumerate(records):
        lc = LayerChoices.from_json(rec["choices"])
        choices.append(lc)
        for name, r in rec["rotations"].items():
            prepared.rotate_in[f"layers.{i}.{name}"] = r
        for name, sc in rec["scales"].items():
            prepared.weight_scales[f"layers.{i}.{name}"] = sc
        for site_name, sc_choice in lc.sites.items():
            for name in CONSUMERS[site_name]:
                prepared.act_clip[f"layers.{i}.{name}"] = sc_choice.act_clip
        for name, lin_choice in lc.linears.items():
            if name in KV_LINEARS:
                prepared.out_clip[f"layers.{i}.{name}"] = lin_choice.out_clip
    return Result(prepared, choices, done)


def _fisher(model: Any, segs: torch.Tensor, cfg: HessianParams,
            progress: Callable[[str, int, int], None] | None) -> dict[str, torch.Tensor]:
    if progress:
        progress("sensitivity", 0, 1)
    out = output_fisher(model, segs, cfg.fisher_draws, cfg.seed)
    if progress:
        progress("sensitivity", 1, 1)
    return out
