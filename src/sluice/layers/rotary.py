"""Rotary position embeddings: inverse frequencies for the RoPE types Sluice supports."""

from __future__ import annotations

import math

import torch

from ..kernels.backend import cpu
from ..errors import ConfigError, UnsupportedModelError
from .pointwise import pointwise

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# NTK-aware base stretching, accepted only by families that ask for it (``Rotary(..., ntk=True)``):
# "ntk_alpha" stretches the base by ``alpha ** (d / (d - 2))`` (Hunyuan, whose checkpoints label
# it "dynamic" with an ``alpha``); "dynamic" (dynamic NTK) rescales the base by the sequence
# length once it exceeds ``max_position_embeddings``. Sluice never runs a context beyond that
# limit, so the frequencies of every position are the ones transformers computes at init.
NTK_ROPE_TYPES = ("dynamic", "ntk_alpha")


def rope_parameters(cfg: dict) -> dict:
    """The RoPE parameters of a raw config.json, in the transformers >= 5 shape."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ConfigError(f"config.json: {key}={cfg[key]!r} is invalid: expected an object")
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    if "partial_rotary_factor" in cfg:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")),
        )
    return params


class Rotary:
    """cos/sin tables for positions; ``dim`` is the rotated part of the head dimension."""

    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int | None = None, ntk: bool = False):
        rope_type = params.get("rope_type", "default")
        supported = SUPPORTED_ROPE_TYPES + (NTK_ROPE_TYPES if ntk else ())
        if rope_type not in supported:
            raise UnsupportedModelError(
                f"RoPE type {rope_type!r} is not supported (supported: {', '.join(supported)})"
            )
        base = float(params["rope_theta"])
        self.dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        self.attention_scaling = 1.0
        if rope_type in NTK_ROPE_TYPES:
            base = _ntk_base(base, self.dim, rope_type, params, max_position_embeddings)
        inv = 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))
        if rope_type == "linear":
            inv = inv / params["factor"]
        elif rope_type == "llama3":
            inv = _llama3(inv, params)
        elif rope_type == "yarn":
            inv, self.attention_scaling = _yarn(base, self.dim, params, max_position_embeddings)
        self.inv_freq = inv

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (int) -> cos, sin [T, dim] fp32."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return pointwise(torch.cos, emb) * self.attention_scaling, pointwise(torch.sin, emb) * self.attention_scaling


class LayerRotary:
    """A RoPE per layer, from a few tables: layer i rotates with ``tables[of_layer[i]]``
    (MiMo-V2-Flash: one theta for its sliding-window layers, another for its full ones).
    ``CausalLM`` computes each table's cos/sin once per forward and hands each layer its own."""

    def __init__(self, tables: list[Rotary], of_layer: list[int]):
        if any(not 0 <= j < len(tables) for j in of_layer):
            raise ValueError(f"layer rotary indices {of_layer} out of range for {len(tables)} tables")
        self.tables, self.of_layer = tables, list(of_layer)

    def cos_sin_layers(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """positions [T] -> each layer's (cos, sin) [T, dim] (layers of one table share them)."""
        per = [t.cos_sin(positions) for t in self.tables]
        return [per[j] for j in self.of_layer]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, d] with d <= D: rotates the first d dims (partial rotary).
    One C call (``cpu.rope``, the same bits) when the kernels are built."""
    d = cos.shape[-1]
    if (x.dim() == 3 and d % 2 == 0 and d <= x.shape[-1] and x.dtype == cos.dtype == sin.dtype == torch.float32
            and cos.shape[0] == x.shape[0] and cpu.norm_available()):
        return cpu.rope(x, cos, sin)
    c, s = cos[:, None, :], sin[:, None, :]
    if d == x.shape[-1]:
        return x * c + rotate_half(x) * s
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat((rot * c + rotate_half(rot) * s, rest), dim=-1)


def apply_rotary_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J style RoPE on the whole head (ERNIE-4.5): dims (2i, 2i+1) are one pair, rotated in
    place by frequency i. x [T, H, D]; cos/sin [T, D] as ``Rotary.cos_sin`` gives them
    (cat(freqs, freqs)): their first half, each value repeated twice. Computed as transformers
    computes it, ``x * cos + rotate_pairs(x) * sin`` with ``rotate_pairs`` = (-x1, x0, -x3, x2, ...)."""
    d = x.shape[-1]
    c = cos[:, None, : d // 2].repeat_interleave(2, dim=-1)
    s = sin[:, None, : d // 2].repeat_interleave(2, dim=-1)
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * c + rotated * s


def _ntk_base(base: float, dim: int, rope_type: str, p: dict, max_pos: int | None) -> float:
    """The stretched RoPE base of the NTK types (in the order transformers computes it, in double)."""
    if dim <= 2:
        raise UnsupportedModelError(f"RoPE type {rope_type!r} needs more than 2 rotated dims, got {dim}")
    if rope_type == "ntk_alpha":
        return base * p["alpha"] ** (dim / (dim - 2))
    if max_pos is None:
        raise UnsupportedModelError("RoPE type 'dynamic' needs max_position_embeddings")
    factor, seq_len = p["factor"], max_pos  # the longest context Sluice runs
    return base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))


def _llama3(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    low_wl, high_wl = old / low, old / high
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, out)


def _yarn(base: float, dim: int, p: dict, max_pos: int | None) -> tuple[torch.Tensor, float]:
    factor = p.get("factor")
    orig = p["original_max_position_embeddings"]
    if factor is None:
        factor = max_pos / orig

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor, attention_factor
