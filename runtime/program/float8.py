"""Float8 linears (ComputeConfig.float8): torchao's float8 training, run on this rank's shards.

Generated code calls one of these per converted nn.Linear (passes/float8.py chose them):

    y = FLOAT8.linear(x, w, b, x_split={'plan': 'K'}, w_split={'plan': 'K'}, out_split={})

Each matmul of the layer (the forward's, and backward's input and weight gradients) casts
its two operands to float8 as torchao's Float8Linear does: torchao's amax, scale and cast
functions, in its recipe's roles and granularities, and torch.mm on torchao's float8 tensors
(`emulate` off a GPU with float8 matmuls). One thing differs: a scale is the full tensor's.
Where a tensor is split over ranks along a dimension its amax reduces over, the amax is
max-reduced over those ranks first, so every rank casts its piece exactly as one device casts
the whole tensor:

- `*_split` names, per mesh axis the tensor is split along, which of its dimensions that is:
  "T" tokens (the leading dimensions of x and the output), "K" the contracted dimension
  (x's last, w's second), "N" the output features (w's first, the output's last);
- data-parallel units hold different tokens: by default each unit scales its own
  (Float8Spec.scales="local", FSDP2's and torchtitan's numerics: one device accumulating the
  units' batches); "global" max-reduces x's and the output gradient's token amaxes over the
  units too (one device running their batches as one batch), at a small collective per cast.

The output gradient is split like the output, except that a partial sum's gradient is whole.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError
from nncompile.float8_spec import RECIPES, require_torchao

from ..store.zero_float8 import float8_data


def torchao_float8():
    """torchao.float8 (a ConfigError saying how to get it where it is not importable)."""
    require_torchao()
    import torchao.float8 as f8
    return f8


def recipe_config(recipe: str, emulate: bool):
    """torchao's Float8LinearConfig for a recipe name ("tensorwise" | "rowwise")."""
    f8 = torchao_float8()
    if recipe not in RECIPES:
        raise ConfigError(f"float8={recipe!r}; choose one of {RECIPES}")
    config = f8.Float8LinearConfig.from_recipe_name(recipe)
    if emulate and not config.emulate:
        config = dataclasses.replace(config, emulate=True)
    return config


def needs_emulation(device: torch.device) -> bool:
    """Whether float8 matmuls are emulated on `device`: anywhere but a GPU of compute
    capability 8.9 or newer (Ada, Hopper, Blackwell)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) < (8, 9)


# the dimension each cast takes its amax over (torchao's axiswise dims, on the 2-d operands
# torch.mm sees: x and the output gradient flattened to tokens x features, w transposed),
# as the split letters above; a tensorwise cast reduces over every dimension
_ROLE_DIMS = {
    ("x", "output"): "K", ("x", "grad_weight"): "T",
    ("w", "output"): "K", ("w", "grad_input"): "N",
    ("go", "grad_input"): "N", ("go", "grad_weight"): "T",
}


class Float8:
    """A rank file's float8 linears: the recipe, torchao's matmul configs and the process
    groups each amax reduces over (made on first use, cached; a copy of the module shares
    them)."""

    def __init__(self, recipe: str, module, scales: str = "local"):
        torchao_float8()
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
        self.recipe, self.scales = recipe, scales
        self.config = recipe_config(recipe, needs_emulation(module.device))
        c = self.config
        self.mm_config = LinearMMConfig(*(
            ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
            for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)))
        self.mesh = module.mesh
        self._mesh_args = (module.PLAN_NGPUS, module.RUNTIME_NGPUS, module.PIPE_RANKS,
                           module.mesh_axes)
        self._groups: dict = {}
        self._casts: dict = {}      # the splits of a call -> each cast's group

    def __deepcopy__(self, memo):
        return self             # configs and process groups: nothing a copy may change

    def group(self, axes: tuple[str, ...]):
        """The process group over mesh `axes` (None: nothing to reduce over)."""
        if not axes or not dist.is_initialized():
            return None
        if axes not in self._groups:
            from ..protocol.groups import group_along
            live = tuple(a for a in axes if dict(self.mesh.dims).get(a, 1) > 1)
            self._groups[axes] = group_along(live, *self._mesh_args) if live else None
        return self._groups[axes]

    def amax_axes(self, tensor: str, role: str, split: dict[str, str]) -> tuple[str, ...]:
        """The mesh axes a cast of `tensor` ("x", "w", "go") for `role`'s matmul reduces its
        amax over: those it is split along in a dimension the amax spans (all of them for a
        tensorwise cast), and the data-parallel units for tokens."""
        tensorwise = self.recipe == "tensorwise"
        dim = _ROLE_DIMS[(tensor, role)]
        axes = [a for a, d in split.items() if tensorwise or d == dim]
        if tensor != "w" and (tensorwise or dim == "T") and self.scales == "global":
            axes.append("dp")
        return tuple(sorted(axes))

    def linear(self, x, w, b, x_split: dict, w_split: dict, out_split: dict):
        """torchao's Float8Linear forward on this rank's pieces (see the module docstring)."""
        if torch.is_autocast_enabled():     # as Float8Linear: the output in autocast's dtype
            x = x.to(torch.get_autocast_gpu_dtype())
        key = (tuple(x_split.items()), tuple(w_split.items()), tuple(out_split.items()))
        groups = self._casts.get(key)
        if groups is None:          # once per layer shape of split: forward runs this often
            groups = self._casts[key] = {
                (t, role): self.group(self.amax_axes(t, role, split))
                for t, split in (("x", x_split), ("w", w_split), ("go", out_split))
                for tt, role in _ROLE_DIMS if tt == t}
        out = _Float8Matmul.apply(x, w.t(), self, groups)
        return out if b is None else out + b.to(out.dtype)


def _cast(f8: Float8, t: torch.Tensor, cast, role, axiswise_dim, group):
    """torchao's dynamic cast of `t` to float8, its amax max-reduced over `group` first."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax
    if cast.scaling_type is ScalingType.DISABLED or float8_data(t) is not None:
        return t            # a weight ZeRO-3 gathered in float8 (runtime/store/zero_float8.py)
    axiswise = cast.scaling_granularity is ScalingGranularity.AXISWISE
    dim = axiswise_dim if axiswise else None
    with torch.no_grad():
        amax = tensor_to_amax(t, False, None, cast.scaling_granularity, dim)
        if group is not None:
            amax = amax.contiguous()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scale = amax_to_scale(amax, cast.target_dtype, f8.config.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, f8.mm_config, role, dim)


class _Float8Matmul(torch.autograd.Function):
    """x @ w_t with both operands cast to float8 in each of the three matmuls, as torchao's
    matmul_with_hp_or_float8_args does (same roles, configs and axiswise dims)."""

    @staticmethod
    def forward(ctx, x, w_t, f8: Float8, groups: dict):
        from torchao.float8.float8_training_tensor import GemmInputRole
        ctx.save_for_backward(x, w_t)
        ctx.f8, ctx.groups = f8, groups
        c = f8.config
        x8 = _cast(f8, x, c.cast_config_input, GemmInputRole.INPUT, -1,
                   groups[("x", "output")])
        w8 = _cast(f8, w_t, c.cast_config_weight, GemmInputRole.WEIGHT, 0,
                   groups[("w", "output")])
        shape = x8.shape
        out = torch.mm(x8.reshape(-1, shape[-1]), w8)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        from torchao.float8.float8_training_tensor import GemmInputRole
        x, w_t = ctx.saved_tensors
        f8, groups, c = ctx.f8, ctx.groups, ctx.f8.config
        go = grad_out.reshape(-1, grad_out.shape[-1])
        go8 = _cast(f8, go, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1,
                    groups[("go", "grad_input")])
        w8 = _cast(f8, w_t, c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1,
                   groups[("w", "grad_input")])
        grad_x = torch.mm(go8, w8.t()).reshape(*grad_out.shape[:-1], w_t.shape[0])
        go8 = _cast(f8, go, c.cast_config_grad_output_for_grad_weight,
                    GemmInputRole.GRAD_OUTPUT, 0, groups[("go", "grad_weight")])
        x2 = x.reshape(-1, x.shape[-1])
        x8 = _cast(f8, x2, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0,
                   groups[("x", "grad_weight")])
        grad_w = torch.mm(go8.t(), x8)
        return grad_x, grad_w.t(), None, None
