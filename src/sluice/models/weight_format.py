"""How a checkpoint stores its linear weights and routed experts, read once from config.json's
``quantization_config`` for every family (``WeightFormat``):

- none: plain f32 / bf16 / f16 ``<module>.weight`` tensors;
- ``quant_method: "fp8"`` (DeepSeek-V3, Kimi K2, MiniMax-M2, GLM-4.x, Qwen3 / Qwen3.5, MiMo, Hy3
  FP8 checkpoints): block-scaled FP8, ``<module>.weight`` e4m3 and ``<module>.weight_scale_inv``
  per ``weight_block_size`` block (``quant/fp8.py``), every linear but those listed in
  ``modules_to_not_convert``;
- ``quant_method: "compressed-tensors"``, ``format: "float-quantized"`` (GLM-4.5-FP8, dots.llm1
  FP8): e4m3 ``<module>.weight`` and ``<module>.weight_scale`` per output channel or per block
  (``quant/compressed_tensors.py``), multiplied as block FP8 (a channel is a block one row high
  and as wide as the row); the linears the config group's ``targets`` cover, less ``ignore``;
- ``quant_method: "compressed-tensors"``, ``format: "pack-quantized"`` (Kimi K2-Thinking,
  K2.5 / K2.6): INT4 routed experts, ``<module>.weight_packed`` / ``<module>.weight_scale``
  (``quant/int4.py``, read as the ``int4`` expert format); every other linear must be in
  ``ignore``, as the released checkpoints have it (an INT4 spine linear is refused by name).

A family may name the scales' tensor itself (``scale_tensor``: DeepSeek-V4's ``<module>.scale``,
ue8m0 bytes), keep linears plain whatever the config says (``keep_plain``: its
``_keep_in_fp32_modules``) and declare FP4 routed experts (``expert_fp4``: ``quant/fp4.py``, e2m1
two per byte with one ue8m0 scale per 32 inputs, the ``fp4`` expert format, kept in FP4).

Every other ``quant_method`` is refused by name. A family builds one ``WeightFormat`` in
``parse_config`` and passes it to ``declare.Model`` (``weights=``), which applies it to every
linear the declaration lists (``Lin``) and to the routed experts (``Model.routed_experts``):
no family holds format code of its own. Both FP8 forms stay FP8 in the spine (``BlockFP8``), in
the expert records, the cache and a container; INT4 experts stay INT4. Activations stay fp32:
results are the model on the exactly dequantized weights (what transformers computes on a
CPU-only machine, where its FP8 loader dequantizes at load).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ..errors import CheckpointError, UnsupportedModelError
from ..experts.spec import ExpertSpec, TensorRef
from ..quant import compressed_tensors as ct
from ..quant.fp4 import FORMAT as FP4_FORMAT
from ..quant.fp8 import SCALE_SUFFIX, BlockFP8, not_converted, parse_quantization_config, scale_shape
from ..quant.mxfp4 import GROUP as FP4_GROUP
from ..quant.int4 import GROUP, PER_WORD

PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_FP8, CT_FP8, INT4 = "fp8", "compressed-tensors fp8", "compressed-tensors int4"
METHODS = ("fp8", ct.METHOD)


def text_quantization(raw: dict, text: dict, where: str = "config.json") -> dict | None:
    """The ``quantization_config`` of a multimodal wrapper's text model: the top-level one (where
    the released wrappers keep it) or ``text_config``'s; both set must be equal."""
    top, own = raw.get("quantization_config"), text.get("quantization_config")
    if top is not None and own is not None and top != own:
        raise UnsupportedModelError(f"{where}: quantization_config differs from text_config.quantization_config "
                                    "(which one the text model uses would be a guess)")
    return top if top is not None else own


class WeightFormat:
    """The stored form of a checkpoint's linears (see the module docstring). ``checkpoint_name``
    maps a spine module name as the declaration writes it (``model.layers.0.self_attn.q_proj``) to
    its name in the checkpoint, which ``modules_to_not_convert`` / ``ignore`` are matched against
    (a multimodal wrapper's ``language_model.`` prefix)."""

    def __init__(self, quantization_config: dict | None = None, where: str = "config.json",
                 checkpoint_name: Callable[[str], str] | None = None, *, scale_tensor: str | None = None,
                 keep_plain: tuple[str, ...] = (), expert_fp4: bool = False):
        """``scale_tensor``: the FP8 scales' tensor after the module name when the checkpoint does
        not use ``.weight_scale_inv`` / ``.weight_scale`` (DeepSeek-V4: ``.scale``); ``keep_plain``:
        module names (suffixes at a ``.`` boundary) stored unquantized whatever the config says,
        as the family's ``_keep_in_fp32_modules`` has transformers keep them; ``expert_fp4``: the
        routed experts are FP4 (``quant/fp4.py``, DeepSeek-V4's ``expert_dtype: "fp4"``)."""
        qc = quantization_config
        self.where = where
        self.kind: str | None = None
        self.block: tuple[int, int] | None = None  # FP8 scale blocks; None: per channel (or not FP8)
        self.scheme: ct.Scheme | None = None
        self.config = qc or None
        self._name = checkpoint_name or (lambda m: m)
        self._scale_tensor = scale_tensor
        self.keep_plain = tuple(keep_plain)
        self.expert_fp4 = expert_fp4
        if not qc:
            return
        if not isinstance(qc, dict):
            raise UnsupportedModelError(f"{where}: quantization_config must be an object, got {qc!r}")
        method = qc.get("quant_method")
        if method == "fp8":
            self.kind, self.block = BLOCK_FP8, parse_quantization_config(qc, where)
        elif method == ct.METHOD:
            self.scheme = ct.parse(qc, where)
            self.kind = INT4 if self.scheme.format == ct.PACKED else CT_FP8
            self.block = self.scheme.block
        else:
            raise UnsupportedModelError(
                f"{where}: quantization_config.quant_method={method!r} is not supported (Sluice reads 'fp8' block-"
                "scaled FP8 and 'compressed-tensors' INT4 pack-quantized / FP8 float-quantized checkpoints; "
                "dequantize other formats first)")

    def with_names(self, checkpoint_name: Callable[[str], str]) -> WeightFormat:
        """The same format for a checkpoint whose spine modules are named ``checkpoint_name(module)``."""
        out = object.__new__(WeightFormat)
        out.__dict__.update(self.__dict__)
        out._name = checkpoint_name
        return out

    @property
    def fp8(self) -> bool:
        return self.kind in (BLOCK_FP8, CT_FP8)

    @property
    def scale_suffix(self) -> str:
        """The FP8 scales' tensor after ``<module>.weight``: ``_scale_inv`` or compressed-tensors' ``_scale``."""
        return SCALE_SUFFIX if self.kind == BLOCK_FP8 else ct.SCALE[len("weight"):]

    def scale_name(self, module: str) -> str:
        """The tensor holding the FP8 (or FP4) scales of linear ``module``."""
        if self._scale_tensor is not None:
            return module + self._scale_tensor
        return module + ".weight" + self.scale_suffix

    def quantized(self, name: str) -> bool:
        """Whether linear ``name`` (its checkpoint name, without ``.weight``) is stored quantized."""
        if any(name == k or name.endswith("." + k) for k in self.keep_plain):
            return False
        if self.kind == BLOCK_FP8:
            return not not_converted(self.config, name)
        if self.scheme is not None:
            return self.scheme.covers(name)
        return False

    def _block(self, k: int) -> tuple[int, int]:
        return self.block if self.block is not None else ct.channel_block(k)

    # -- spine linears (declare.Model applies these to every ``Lin``) ------------------------------

    def tensors(self, module: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The stored tensors of one linear module: its weight, and its FP8 scales if it is FP8."""
        out: dict[str, tuple[int, ...]] = {module + ".weight": tuple(shape)}
        name = self._name(module)
        if not self.quantized(name):
            return out
        if self.kind == INT4:
            raise UnsupportedModelError(
                f"{self.where}: quantization_config covers {name!r}: compressed-tensors INT4 is read for routed "
                "experts only (the released checkpoints list every other linear in 'ignore')")
        out[self.scale_name(module)] = scale_shape(tuple(shape), self._block(shape[1]))
        return out

    def linear(self, w, module: str):
        """The built linear of ``module``: a ``BlockFP8`` over the stored tensors, or the plain weight."""
        weight = w(module + ".weight")
        if self.fp8 and self.quantized(self._name(module)):
            scale = w(self.scale_name(module))
            return BlockFP8(weight, scale, self._block(weight.shape[1]), module + ".weight")
        if isinstance(weight, torch.Tensor) and weight.dtype not in PLAIN_DTYPES:
            raise CheckpointError(
                f"tensor {module + '.weight'!r} is {weight.dtype}, but config.json declares no quantization for it "
                "(quantization_config / modules_to_not_convert / ignore)")
        return weight

    # -- routed experts ----------------------------------------------------------------------------

    def experts(self, spec: ExpertSpec, template: str, names: dict[str, str], layers: list[int]) -> dict:
        """``expert``, ``expert_tensors`` and ``expert_format`` of a ``ModelDescription`` for routed
        experts whose matrices are the linear modules ``template.format(layer=, e=, name=names[role])``
        (checkpoint names, without ``.weight``); ``layers``: the MoE layers."""
        shapes = spec.matrix_shapes()
        first = [template.format(layer=layers[0], e=0, name=n) for n in names.values()] if layers else []
        stored = {self.quantized(m) for m in first}
        if len(stored) > 1:
            raise UnsupportedModelError(
                f"{self.where}: quantization_config covers some of {first} and not the others (an expert's "
                "matrices must share one format)")
        quantized = stored == {True}
        if self.kind == INT4 and layers and not quantized:
            raise UnsupportedModelError(
                f"{self.where}: quantization_config (compressed-tensors INT4) does not cover the routed experts "
                f"({first[0]!r}): Sluice reads INT4 routed experts only")
        if not quantized:
            def plain(layer: int, e: int) -> dict[str, TensorRef]:
                return {role: TensorRef(template.format(layer=layer, e=e, name=n) + ".weight", shapes[role])
                        for role, n in names.items()}
            return dict(expert=spec, expert_tensors=plain, expert_format=None)
        if self.kind == INT4:
            bad = {role: k for role, (_, k) in shapes.items() if k % GROUP}
            if bad:
                raise UnsupportedModelError(
                    f"{self.where}: hidden_size={spec.hidden} and the experts' intermediate size {spec.intermediate} "
                    f"must be multiples of {GROUP} for INT4 group-{GROUP} experts")

            def packed(layer: int, e: int) -> dict[str, TensorRef]:
                refs = {}
                for role, n in names.items():
                    m, (rows, k) = template.format(layer=layer, e=e, name=n), shapes[role]
                    refs[f"{role}.packed"] = TensorRef(m + ".weight_packed", (rows, k // PER_WORD))
                    refs[f"{role}.scale"] = TensorRef(m + ".weight_scale", (rows, k // GROUP))
                return refs
            return dict(expert=spec, expert_tensors=packed, expert_format="int4")
        if self.expert_fp4:
            bad = {role: k for role, (_, k) in shapes.items() if k % FP4_GROUP}
            if bad:
                raise UnsupportedModelError(
                    f"{self.where}: hidden_size={spec.hidden} and the experts' intermediate size {spec.intermediate} "
                    f"must be multiples of {FP4_GROUP} for FP4 experts (one ue8m0 scale per {FP4_GROUP} inputs)")

            def fp4(layer: int, e: int) -> dict[str, TensorRef]:
                refs = {}
                for role, n in names.items():
                    m, (rows, k) = template.format(layer=layer, e=e, name=n), shapes[role]
                    refs[f"{role}.weight"] = TensorRef(m + ".weight", (rows, k // 2))
                    refs[f"{role}.scale"] = TensorRef(self.scale_name(m), (rows, k // FP4_GROUP))
                return refs
            return dict(expert=spec, expert_tensors=fp4, expert_format=FP4_FORMAT)
        # FP8: one block for the three matrices (per channel: a row as wide as the widest input)
        block = self._block(max(k for _, k in shapes.values()))

        def fp8(layer: int, e: int) -> dict[str, TensorRef]:
            refs = {}
            for role, n in names.items():
                m = template.format(layer=layer, e=e, name=n)
                refs[role] = TensorRef(m + ".weight", shapes[role])
                refs[role + SCALE_SUFFIX] = TensorRef(self.scale_name(m), scale_shape(shapes[role], block))
            return refs
        return dict(expert=replace(spec, block=block), expert_tensors=fp8, expert_format=None)

    def notes(self) -> list[str]:
        """What ``sluice inspect`` says about the stored form."""
        if self.kind == BLOCK_FP8:
            b = self.block
            scales = "ue8m0 (power-of-two) " if (self.config or {}).get("scale_fmt") == "ue8m0" else ""
            out = [f"FP8 e4m3 weights with {b[0]}x{b[1]} {scales}block scales, kept in FP8 (activations stay fp32)"]
            if self.expert_fp4:
                out.append(f"routed experts: FP4 e2m1 with one ue8m0 scale per {FP4_GROUP} inputs, kept in FP4 and "
                           "multiplied exactly as stored (activations stay fp32)")
            return out
        if self.kind == CT_FP8:
            scales = "per-channel scales" if self.block is None else f"{self.block[0]}x{self.block[1]} block scales"
            acts = "; its dynamic activation quantization is not applied" if self.scheme.dynamic_activations else ""
            return [f"compressed-tensors FP8 e4m3 weights with {scales} (weight_scale), kept in FP8 (activations "
                    f"stay fp32{acts})"]
        if self.kind == INT4:
            return ["routed experts: compressed-tensors INT4 (group 32, bf16 scales), kept in INT4 and multiplied "
                    "exactly as stored (activations stay fp32)"]
        return []


PLAIN = WeightFormat()
