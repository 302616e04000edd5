"""ComputeConfig.float8: which nn.Linear layers train in float8, and how their scales are taken.

    ComputeConfig(2, float8="tensorwise")                   # a recipe name, or
    ComputeConfig(2, float8=nncompile.Float8Spec("rowwise", filter="all", skip=("lm_head",)))

The numerics are torchao's Float8Linear (`convert_to_float8_training`) for the recipe, with
every scale taken over the full tensor however the plan splits it (runtime/program/float8.py). Which
layers convert follows torchao's filters: `filter="auto"` is torchao's size filter for the
recipe (layers too small to gain are skipped), `"all"` converts every nn.Linear whose two
dimensions are multiples of 16 (float8 matmuls need that); layers named in `skip` (the output
head by default) never convert. plan.json's `float8` lists every nn.Linear with what was
decided and why. `module_filter(spec)` is the same decision as torchao's `module_filter_fn`,
for a one-device reference:

    convert_to_float8_training(model, config=..., module_filter_fn=nncompile.float8_module_filter("tensorwise", filter="all"))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .errors import ConfigError

RECIPES = ("tensorwise", "rowwise")
FILTERS = ("auto", "all")
SCALES = ("global", "local")


@dataclass(frozen=True)
class Float8Spec:
    recipe: str = "tensorwise"          # torchao's recipe: "tensorwise" or "rowwise"
    filter: str = "auto"                # "auto": torchao's size filter; "all": every layer
    #                                     whose dimensions are multiples of 16
    skip: tuple[str, ...] = ("lm_head", "output")   # module names or FQNs never converted
    scales: str = "local"               # "local": each data-parallel unit scales its own
    #                                     tokens (FSDP2's and torchtitan's numerics, one device
    #                                     accumulating the units' batches); "global": token
    #                                     amaxes reduced over the units too (one device running
    #                                     their batches as one)
    all_gather: bool = True             # ZeRO-3 gathers converted weights in float8 (the
    #                                     tensorwise recipe: torchao's float8 all-gather)

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ConfigError(f"float8 recipe {self.recipe!r}; choose one of {RECIPES} "
                              "(torchao's Float8LinearConfig.from_recipe_name)")
        if self.filter not in FILTERS:
            raise ConfigError(f"Float8Spec(filter={self.filter!r}); choose one of {FILTERS}")
        if self.scales not in SCALES:
            raise ConfigError(f"Float8Spec(scales={self.scales!r}); choose one of {SCALES}")
        if not isinstance(self.all_gather, bool):
            raise ConfigError(f"Float8Spec(all_gather={self.all_gather!r}); pass True (ZeRO-3 "
                              "gathers converted weights in float8) or False (in high "
                              "precision)")
        skip = self.skip
        if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
            raise ConfigError(f"Float8Spec(skip={skip!r}); give a tuple of module names or "
                              "FQNs, e.g. ('lm_head',)")
        object.__setattr__(self, "skip", tuple(skip))

    @classmethod
    def of(cls, value) -> "Float8Spec | None":
        """ComputeConfig.float8 as a spec: None, a recipe name, or a Float8Spec."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(value)
        raise ConfigError(f"float8={value!r}; pass a recipe name {RECIPES}, a "
                          "nncompile.Float8Spec, or None")


def require_torchao() -> None:
    """ConfigError, saying how to get it, where torchao's float8 training is not importable."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ConfigError("ComputeConfig(float8=...) trains nn.Linear layers with torchao's "
                          f"float8 recipes, and torchao is not importable ({e}); "
                          "pip install torchao") from e


def why_not(mod: torch.nn.Module, fqn: str, spec: Float8Spec) -> str | None:
    """None if `mod` (at `fqn`) converts to float8, else the reason it does not."""
    if not isinstance(mod, torch.nn.Linear):
        return "not an nn.Linear"
    name = fqn.rsplit(".", 1)[-1]
    if fqn in spec.skip or name in spec.skip:
        return f"named in float8 skip {spec.skip}"
    n, k = mod.weight.shape
    if n % 16 or k % 16:
        return f"weight {n} x {k}: float8 matmuls need dimensions that are multiples of 16"
    if spec.filter == "auto":
        from .compat import torchao_auto_filter
        auto = torchao_auto_filter(spec.recipe)
        if auto is None:
            raise ConfigError("this torchao has no size filter for float8 layers; pass "
                              "Float8Spec(filter='all') and name the layers to keep in "
                              "high precision in skip=(...)")
        if not auto(mod, fqn):
            return (f"weight {n} x {k}: too small to gain from float8 (torchao's auto filter "
                    f"for {spec.recipe}); Float8Spec(filter='all') converts it")
    return None


def module_filter(spec: Float8Spec | str, filter: str | None = None,
                  skip: tuple[str, ...] | None = None) -> Callable[[torch.nn.Module, str], bool]:
    """torchao's `module_filter_fn` that converts exactly the layers nncompile converts."""
    spec = Float8Spec.of(spec)
    if filter is not None or skip is not None:
        spec = Float8Spec(spec.recipe, filter or spec.filter,
                          spec.skip if skip is None else skip, spec.scales, spec.all_gather)
    return lambda mod, fqn: why_not(mod, fqn, spec) is None


def float8_layers(module: torch.nn.Module, spec: Float8Spec) -> dict[str, str | None]:
    """{FQN: None (converts) or why not} for every nn.Linear of `module`."""
    return {fqn: why_not(mod, fqn, spec) for fqn, mod in module.named_modules()
            if isinstance(mod, torch.nn.Linear)}
