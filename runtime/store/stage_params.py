"""Under a pipeline, the module given to parallelize holds only this rank's stages' weights.

Each pipeline rank trains the parameters of its own stages. The other stages' parameters are
taken out of its copy of the user's module (each set to None in its owner, as torch's
modules allow), so `parameters()`, `named_parameters()` and `state_dict()` list this rank's
stages only, as a torchtitan pipeline rank's model part does, and DCP collects every FQN from
the ranks that train it. Their memory is freed; a reference kept from before parallelize
computes nothing (released.py). Calling the module is an error naming pm:

    before: rank 0: pm.module.state_dict()["h.1.mlp_proj.bias"]   stage 1's, never trained here
            dcp.save(get_model_state_dict(pm.module)) -> stage 1's weights of step 0 possibly
    after:  rank 0's module lists stage 0's parameters; rank 1's stage 1's (a tied weight
            both, the same values); dcp.save writes every weight as trained
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError

from ..protocol.groups import pipe_group
from .released import ReleasedParameter, _free


def release_other_stages(pm, module: torch.nn.Module, rows) -> None:
    """Take out of `module` the parameters that another pipeline rank's stages hold and this
    rank's do not (a collective over the pipeline ranks: which FQNs each holds)."""
    if pm.PIPELINE is None or module is None or pm.INFERENCE_ONLY or not dist.is_initialized():
        return
    params = list(module.named_parameters(remove_duplicate=False))
    if any(p.is_meta for _, p in params):
        return
    mine = {row.fqn for row in rows} | {row.source for row in rows}
    group, ranks = pipe_group(pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS, pm.mesh_axes)
    held: list = [None] * len(ranks)
    dist.all_gather_object(held, sorted(mine), group=group)
    elsewhere = set().union(*map(set, held)) - mine
    kept = {id(p) for fqn, p in params if fqn in mine}      # a tie held here stays
    gone = []
    for fqn, p in params:
        if fqn not in elsewhere or id(p) in kept:
            continue
        if p.numel() and getattr(p, "_nnc_origin", None) is None:
            if p.untyped_storage().size():
                p.grad = None
                _free(p)
            if type(p) is torch.nn.Parameter:
                p.__class__ = ReleasedParameter
        owner, _, leaf = fqn.rpartition(".")
        module.get_submodule(owner)._parameters[leaf] = None
        gone.append(fqn)
    if gone:
        module.register_forward_pre_hook(_other_stages_forward(gone[0]))


def _other_stages_forward(example: str):
    owner, _, leaf = example.rpartition(".")

    def hook(module, args):
        try:
            held = module.get_submodule(owner)._parameters
        except AttributeError:          # the submodule was replaced since (by pm, say)
            return None
        if leaf not in held or held[leaf] is not None:
            return None
        raise ConfigError(
            f"{type(module).__name__} was parallelized into pipeline stages: this rank holds "
            f"only its stages' parameters ({example!r} belongs to another pipeline rank's "
            f"stage), so the module cannot run here; call the ParallelModule that "
            f"nncompile.parallelize returned (pm.train_step(...) or pm(...)), or parallelize "
            f"a copy (copy.deepcopy(model)) to keep this one whole")
    return hook
