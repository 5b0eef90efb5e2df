"""Reading config.json values with errors that name the key and the value.

Every family's ``parse_config`` reads its keys through ``RawConfig``, whose typed getters
check the type (a list, a string or a boolean where a number is expected is refused) and
the range (positive head counts and sizes, finite positive ``rms_norm_eps`` and
``rope_theta``, top-k within the experts, ...). Errors are ``ConfigError`` (a
``CheckpointError``) naming the key and the value; options that are valid but not
implemented stay ``UnsupportedModelError``.
"""

from __future__ import annotations

import builtins
import math
import re

from ..errors import CheckpointError, ConfigError, UnsupportedModelError, shown

REQUIRED = object()

# Far above any real model, far below what would exhaust memory when describing or planning it.
MAX_LAYERS = 1 << 14
MAX_DIM = 1 << 24  # hidden, intermediate and vocabulary sizes, positions per head group...
MAX_HEADS = 1 << 14
MAX_HEAD_DIM = 1 << 14
MAX_EXPERTS = 1 << 16
MAX_POSITIONS = 1 << 31


class RawConfig:
    """A config.json dict with typed, named, range-checked access."""

    def __init__(self, raw: dict, where: str = "config.json"):
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: must be a JSON object, got {type(raw).__name__}")
        self.raw = raw
        self.where = where

    def __contains__(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def _find(self, key: str, default, aliases: tuple[str, ...]):
        """(the key that was found, its value), or (key, default) when none is set."""
        for k in (key, *aliases):
            v = self.raw.get(k)
            if v is not None:
                return k, v, True
        if default is REQUIRED:
            names = " or ".join(repr(k) for k in (key, *aliases))
            raise CheckpointError(f"{self.where}: missing required key {names}")
        return key, default, False

    def bad(self, key: str, value, expected: str) -> ConfigError:
        """The error for ``key`` holding ``value`` where ``expected`` was needed."""
        return ConfigError(f"{self.where}: {key}={shown(value)} is invalid: expected {expected}")

    def get(self, key: str, default=REQUIRED, *aliases: str):
        return self._find(key, default, aliases)[1]

    def int(self, key: str, default=REQUIRED, *aliases: str, lo: int | None = None, hi: int | None = None,
            null=REQUIRED):
        """An integer (``None`` only as an explicit default), within ``lo..hi`` if given; ``null``: the
        value of an explicit JSON null (by default a null counts as absent and gets ``default``)."""
        if null is not REQUIRED and key in self.raw and self.raw[key] is None:
            return null
        k, v, found = self._find(key, default, aliases)
        if v is None and not found:
            return None
        if isinstance(v, bool) or not isinstance(v, builtins.int):
            raise self.bad(k, v, _int_range(lo, hi))
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.bad(k, v, _int_range(lo, hi))
        return v

    def pos_int(self, key: str, default=REQUIRED, *aliases: str, hi: int = MAX_DIM):
        """An integer in ``1..hi``."""
        return self.int(key, default, *aliases, lo=1, hi=hi)

    def float(self, key: str, default=REQUIRED, *aliases: str, positive: bool = False,
              lo: builtins.float | None = None) -> builtins.float:
        """A finite number (NaN and infinities are refused), ``> 0`` if ``positive``, ``>= lo`` if given."""
        k, v, _ = self._find(key, default, aliases)
        return number(v, k, self.where, positive=positive, lo=lo)

    def bool(self, key: str, default=REQUIRED, *aliases: str) -> builtins.bool:
        """``true``/``false`` (0 and 1 accepted); a string such as ``"false"`` is refused."""
        k, v, _ = self._find(key, default, aliases)
        if isinstance(v, builtins.bool):
            return v
        if isinstance(v, builtins.int) and v in (0, 1):
            return builtins.bool(v)
        raise self.bad(k, v, "true or false")

    def str(self, key: str, default=REQUIRED, *aliases: str) -> builtins.str:
        k, v, _ = self._find(key, default, aliases)
        if not isinstance(v, builtins.str):
            raise self.bad(k, v, "a string")
        return v

    def act(self, key: str = "hidden_act", default: builtins.str = "silu") -> builtins.str:
        """The activation's name; one Sluice does not implement is refused now, at load."""
        from ..layers.mlp import activation

        name = self.str(key, default)
        try:
            activation(name)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{self.where}: {key}={name!r}: {e}") from None
        return name

    def int_list(self, key: str, default=(), lo: int = 0, hi: int | None = None) -> list[int]:
        """A list of integers in ``lo..hi`` (e.g. layer indices)."""
        k, v, _ = self._find(key, list(default), ())
        if not isinstance(v, list) or any(isinstance(x, builtins.bool) or not isinstance(x, builtins.int)
                                          or x < lo or (hi is not None and x > hi) for x in v):
            raise self.bad(k, v, f"a list of integers {_int_range(lo, hi, bare=True)}")
        return v

    def top_k(self, key: str, n_experts: int, default=REQUIRED, *aliases: str) -> int:
        """Experts per token: ``1..n_experts``."""
        k, v, _ = self._find(key, default, aliases)
        if isinstance(v, builtins.bool) or not isinstance(v, builtins.int) or not 1 <= v <= n_experts:
            raise ConfigError(f"{self.where}: {k}={shown(v)} is invalid: expected an integer from 1 to the "
                              f"{n_experts} experts")
        return v

    def layers(self, key: str = "num_hidden_layers") -> int:
        return self.pos_int(key, hi=MAX_LAYERS)

    def eps(self, default: builtins.float, key: str = "rms_norm_eps") -> builtins.float:
        return self.float(key, default, positive=True)

    def heads(self, hidden: int, *, kv_divides: builtins.bool = True, head_dim: builtins.bool = True):
        """(num_attention_heads, num_key_value_heads, head_dim), each positive; the key/value
        heads must divide the query heads (grouped-query attention) when ``kv_divides``."""
        heads = self.pos_int("num_attention_heads", hi=MAX_HEADS)
        kv = self.pos_int("num_key_value_heads", heads, hi=MAX_HEADS)
        if kv_divides and heads % kv:
            raise ConfigError(f"{self.where}: num_key_value_heads={kv} is invalid: it must divide "
                              f"num_attention_heads={heads} (each key/value head serves a whole group)")
        if not head_dim:
            return heads, kv, None
        if "head_dim" not in self and hidden // heads < 1:
            raise ConfigError(f"{self.where}: num_attention_heads={heads} is invalid: more heads than "
                              f"hidden_size={hidden} and no head_dim")
        dim = self.pos_int("head_dim", hidden // heads, hi=MAX_HEAD_DIM)
        return heads, kv, dim

    def sliding_window(self, key: str = "sliding_window") -> int | None:
        """``null`` (attend to the whole context) or a positive window."""
        return self.int(key, None, lo=1, hi=MAX_POSITIONS)

    def refuse(self, key: str, allowed, why: str) -> None:
        """Refuse a config option whose value Sluice does not implement."""
        v = self.raw.get(key)
        if v is not None and v not in allowed:
            raise UnsupportedModelError(f"{self.where}: {key}={v!r} is not supported ({why})")


def number(v, key: str, where: str = "config.json", *, positive: bool = False,
           lo: float | None = None) -> float:
    """``v`` as a finite float; refuses booleans, strings, NaN, infinities and values out of range."""
    want = "a finite number" + (" > 0" if positive else f" >= {lo}" if lo is not None else "")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where}: {key}={shown(v)} is invalid: expected {want}")
    f = float(v)
    if not math.isfinite(f) or (positive and f <= 0) or (lo is not None and f < lo):
        raise ConfigError(f"{where}: {key}={shown(v)} is invalid: expected {want}")
    return f


def check_rope(params: dict, where: str = "config.json") -> dict:
    """Refuse RoPE parameters that would give garbage: a non-finite or non-positive ``rope_theta``
    or ``factor``, a ``partial_rotary_factor`` outside (0, 1]. Returns ``params``."""
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: rope_parameters={shown(params)} is invalid: expected an object")
    number(params.get("rope_theta"), "rope_theta", where, positive=True)
    for key in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            number(params[key], key, where, positive=key not in ("mscale", "mscale_all_dim"), lo=0.0)
    if "partial_rotary_factor" in params:
        p = number(params["partial_rotary_factor"], "partial_rotary_factor", where, positive=True)
        if p > 1:
            raise ConfigError(f"{where}: partial_rotary_factor={shown(params['partial_rotary_factor'])} is "
                              "invalid: expected a number in (0, 1]")
    return params


# a decoder layer's tensor names: a text model's (``model.layers.N.``) or inside a multimodal
# wrapper (Qwen3.5's ``model.language_model.layers.N.``, Kimi K2.5's ``language_model.model.layers.N.``)
_LAYER = re.compile(r"((?:model\.(?:language_model\.)?|language_model\.model\.)layers\.)(\d+)\.")


def check_layer_count(n_layers: int, names, extra: int = 0, where: str = "config.json") -> None:
    """The checkpoint holds tensors for exactly layers ``0 .. n_layers + extra - 1`` (``extra``:
    multi-token-prediction layers stored after the decoder's), under a text model's or a
    multimodal wrapper's layer prefix. Runs before anything is sized by the layer count, so an
    absurd ``num_hidden_layers`` costs nothing."""
    present: dict[int, str] = {}
    for name in names:
        m = _LAYER.match(name)
        if m:
            present.setdefault(int(m.group(2)), m.group(1))
    if not present:
        return  # a layout without model.layers.N (the family's own checks name what is missing)
    top = max(present)
    layers = present[top]
    if top + 1 < n_layers:
        raise ConfigError(f"{where}: num_hidden_layers={n_layers} but the checkpoint has tensors for only "
                          f"{top + 1} layers ({layers}0 .. {layers}{top}): config and weights disagree")
    if top >= n_layers + extra:
        raise ConfigError(f"{where}: num_hidden_layers={n_layers} but the checkpoint has tensors for layer "
                          f"{top} ({layers}{top}.*): config and weights disagree")


def _int_range(lo, hi, bare: bool = False) -> str:
    if lo is not None and hi is not None:
        r = f"in {lo}..{hi}"
    elif lo is not None:
        r = f">= {lo}"
    elif hi is not None:
        r = f"<= {hi}"
    else:
        return "" if bare else "an integer"
    return r if bare else f"an integer {r}"


def eos_ids(raw: dict, generation_config: dict | None = None) -> list[int]:
    """The ids generation stops at: config.json's ``eos_token_id`` (a multimodal wrapper's,
    else its ``text_config``'s, as transformers fills an unset generation field from the text
    model's config) and generation_config.json's, in that order, each once."""
    out: list[int] = []
    text = raw.get("text_config")
    model = raw if raw.get("eos_token_id") is not None or not isinstance(text, dict) else text
    for src in (model, generation_config or {}):
        v = src.get("eos_token_id")
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and x not in out:
                out.append(x)
    return out
