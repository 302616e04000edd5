"""What `model.save_pretrained(dir)` writes, worked out from shapes and dtypes alone.

Given the module's state keys with their full shapes and dtypes (no weights), and where there
is one the Hugging Face model they belong to (real, released or on `meta`), `plan_layout`
decides, as transformers does:

    saved names   tied weights once (transformers' own choice of which name stays), and the
                  model's weight conversions reverted: Mixtral's fused
                  `mlp.experts.gate_up_proj` [E, 2I, H] is saved as the original
                  `block_sparse_moe.experts.{e}.w1/w3.weight` [I, H]
    files         huggingface_hub's split into `model.safetensors`, or
                  `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`

and in which *groups* the tensors move: a renamed tensor alone (and read back as a slice), the
tensors a conversion joins together one layer at a time. So whoever writes or reads the files
holds one tensor, or one layer's converted tensors, at a time.

    before: {"model.layers.0.mlp.experts.gate_up_proj": ((4, 128, 32), float32), ...}
    after:  Group(fqns=[".. gate_up_proj", ".. down_proj"],
                  saved=[".. experts.0.w1.weight", ...], renamed={})
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CheckpointError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass
class Group:
    """State keys that move together, and the saved tensors they become."""
    fqns: list[str]
    saved: list[str]
    renamed: dict[str, str] = field(default_factory=dict)   # saved name -> state key (as is)

    @property
    def converted(self) -> bool:
        return len(self.renamed) < len(self.saved)


@dataclass
class Layout:
    groups: list[Group]
    specs: dict[str, tuple[tuple, torch.dtype]]     # saved name -> (shape, dtype)
    files: dict[str, list[str]]                     # file name -> saved names
    index: dict | None                              # the index file's content when sharded
    tied: dict[str, str]                            # state key not saved -> the one saved


def is_pretrained(module: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)


def find_pretrained(module: torch.nn.Module | None) -> tuple[str, Any] | None:
    """(FQN prefix, model) of the first outermost Hugging Face model in `module` (itself:
    prefix ""), or None."""
    found = pretrained_models(module)
    return found[0] if found else None


def pretrained_models(module: torch.nn.Module | None) -> list[tuple[str, Any]]:
    """(FQN prefix, model) of every outermost Hugging Face model in `module`, in module
    order: a DPO or distillation wrapper holds two (a frozen reference and the policy)."""
    out: list[tuple[str, Any]] = []
    for name, sub in (module.named_modules() if module is not None else ()):
        prefix = f"{name}." if name else ""
        if is_pretrained(sub) and not any(prefix.startswith(p) for p, _ in out):
            out.append((prefix, sub))
    return out


def reference_model(config: Any) -> Any:
    """The Hugging Face model a config describes (its `architectures[0]`; a causal LM when it
    names none), built on meta: its names, ties and weight conversions, no weights."""
    import transformers
    archs = getattr(config, "architectures", None) or []
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), None)
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            raise CheckpointError(
                f"the config names no architecture transformers knows (architectures={archs}, "
                f"model_type {getattr(config, 'model_type', None)!r}) and is no causal LM; "
                "pass a config saved by model.save_pretrained") from None


def plan_layout(state: dict[str, tuple[tuple, torch.dtype]], aliases: dict[str, str],
                model: Any = None, max_shard_size: int | str = "50GB",
                nparams: int | None = None) -> Layout:
    """The layout of `state` ({state key: (full shape, dtype)}, every key the module's
    state_dict() has, without a prefix) saved by `model` (a Hugging Face model, or None for
    any other module: names kept, each tied weight under its first name). `aliases` maps a
    tied key to the key it shares storage with; `nparams`, the model's parameter count for
    the index (None: model.num_parameters(), where the model holds every parameter)."""
    meta = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in
            state.items()}
    kept = _untie(meta, aliases, model)
    tied = {k: aliases.get(k, k) for k in state if k not in kept}
    revert = reverter(model)
    saved = revert(kept)
    groups, seen = [], set()
    converted: dict[str, list[str]] = {}
    for k, t in kept.items():
        out = revert({k: t})
        if len(out) == 1 and next(iter(out.values())) is t:
            name = next(iter(out))
            groups.append(Group([k], [name], {name: k}))
            seen.add(name)
        else:
            converted.setdefault(_layer(k), []).append(k)
    for keys in converted.values():
        out = revert({k: kept[k] for k in keys})
        groups.append(Group(keys, list(out)))
        seen.update(out)
    if seen != set(saved):
        raise CheckpointError(
            f"{type(model).__name__}'s weight conversions join tensors of different layers "
            f"(e.g. {sorted(seen ^ set(saved))[:3]}); nncompile cannot save them tensor by "
            "tensor")
    specs = {k: (tuple(t.shape), t.dtype) for k, t in saved.items()}
    files, index = _split(saved, model, max_shard_size, nparams)
    return Layout(groups, specs, files, index, tied)


def _untie(meta: dict[str, torch.Tensor], aliases: dict[str, str], model: Any
           ) -> dict[str, torch.Tensor]:
    """The state without the tied keys transformers does not save (its own function, which
    keeps the name the model expects on reload); otherwise without the later names.
    transformers finds ties by storage: it is shown one 1-element tensor per weight, the
    same one under every name of a tied weight, so the model's own parameters are never
    looked up (a pipeline rank's module holds its stages' only)."""
    if model is not None:
        try:
            from transformers.modeling_utils import remove_tied_weights_from_state_dict
        except ImportError:
            remove_tied_weights_from_state_dict = None
        if remove_tied_weights_from_state_dict is not None:
            one: dict[str, torch.Tensor] = {}
            probe = {k: one.setdefault(aliases.get(k, k), torch.empty(1, dtype=t.dtype))
                     for k, t in meta.items()}
            return {k: meta[k] for k in remove_tied_weights_from_state_dict(probe, model)}
    return {k: t for k, t in meta.items() if aliases.get(k, k) == k}


def reverter(model: Any):
    """{state key: tensor} -> {saved name: tensor}: transformers' revert_weight_conversion for a
    model that has conversions (transformers 5), names as they are otherwise."""
    if model is None:
        return dict
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return dict
    return lambda sd: revert_weight_conversion(model, sd)


def _layer(key: str) -> str:
    """The key up to its first numeric component ("model.layers.3"), "" when it has none: the
    tensors of one layer are converted together."""
    parts = key.split(".")
    i = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return "" if i is None else ".".join(parts[:i + 1])


def _split(saved: dict[str, torch.Tensor], model: Any, max_shard_size: int | str,
           nparams: int | None = None) -> tuple[dict[str, list[str]], dict | None]:
    """huggingface_hub's split into files (in the saved order), and the index when sharded."""
    from huggingface_hub import split_state_dict_into_shards_factory
    split = split_state_dict_into_shards_factory(
        saved, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size,
        get_storage_id=lambda t: id(_root(t)), get_storage_size=lambda t: _root(t).nbytes)
    files = {f: list(names) for f, names in split.filename_to_tensors.items()}
    if not split.is_sharded:
        return files, None
    meta: dict[str, Any] = dict(split.metadata)
    if model is not None and hasattr(model, "num_parameters"):
        meta = {"total_parameters": model.num_parameters() if nparams is None else nparams,
                **meta}
    return files, {"metadata": meta, "weight_map": dict(split.tensor_to_filename)}


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage `t` views: the saved experts of one layer are views of its
    fused tensor, which transformers' split keeps in one file and counts once."""
    return t if t._base is None else t._base


def stale_shards(names: list[str], keep: dict[str, list[str]]) -> list[str]:
    """Files of an earlier sharded save in the directory that this save does not write."""
    return [n for n in names if _SHARD.fullmatch(n) and n not in keep]


def config_files(model: Any, config: Any, dtype: torch.dtype | None) -> dict[str, str]:
    """{file name: JSON text} written beside the weights: `config.json` (with the weights'
    dtype and the model's class, as transformers records them) and `generation_config.json`
    for a model that generates; a plain dict config is written as it is."""
    import json
    if config is None and model is not None:
        config = model.config
    if config is None:
        return {}
    if isinstance(config, dict):
        return {"config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"}
    if dtype is not None:
        config.dtype = str(dtype).split(".")[1]
    if model is not None:
        config.architectures = [type(model).__name__.removeprefix("FSDP")]
    out = {"config.json": config.to_json_string(use_diff=True)}
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        out["generation_config.json"] = gen.to_json_string(use_diff=True)
    return out


def weights_dtype(state: dict[str, tuple[tuple, torch.dtype]]) -> torch.dtype | None:
    """The model's dtype as transformers reads it: its first floating-point tensor's."""
    return next((dtype for _, dtype in state.values() if dtype.is_floating_point), None)


def converted_values(model: Any, group: Group, saved: dict[str, torch.Tensor],
                     state: dict[str, tuple[tuple, torch.dtype]]) -> dict[str, torch.Tensor]:
    """The state tensors of a converted group from its saved tensors: the conversion is run
    backwards on element numbers (stacks, concatenations, chunks, transposes move elements,
    they do not compute), which says where each saved element goes."""
    numels = [int(torch.Size(state[k][0]).numel()) for k in group.fqns]
    total = sum(numels)
    kind = torch.int32 if total < 2 ** 31 else torch.int64
    ids, offsets, at = {}, [], 0
    for k, n in zip(group.fqns, numels):
        ids[k] = torch.arange(at, at + n, dtype=kind).view(state[k][0])
        offsets.append(at)
        at += n
    where = reverter(model)(ids)
    out = {k: torch.empty(state[k][0], dtype=state[k][1]) for k in group.fqns}
    filled = [0] * len(group.fqns)
    for name in group.saved:
        idx, vals = where[name].reshape(-1).long(), saved[name].reshape(-1)
        for i, (k, off, n) in enumerate(zip(group.fqns, offsets, numels)):
            mask = (idx >= off) & (idx < off + n)
            if bool(mask.any()):
                out[k].view(-1)[idx[mask] - off] = vals[mask].to(state[k][1])
                filled[i] += int(mask.sum())
    for k, n, f in zip(group.fqns, numels, filled):
        if f != n:
            raise CheckpointError(f"the saved tensors {group.saved[:3]} do not fill {k!r} "
                                  f"({f} of {n} elements)")
    return out
