"""Under a pipeline, the module given to parallelize keeps only this rank's stages' weights.

Each pipeline rank trains the parameters of its own stages. The other stages' parameters in
its copy of the user's module are never updated there, so reading them gave the weights of
step 0, and `get_model_state_dict(pm.module)` + `dcp.save` wrote those stale copies (DCP keeps
one rank's copy of a plain tensor: which one is not this rank's choice). They are released
instead (their memory freed, computing with them a clear error), and the module's
`state_dict()` leaves them out, as a torchtitan pipeline rank's model part holds its stages
only; DCP then collects every FQN from the ranks that train it:

    before: rank 0: pm.module.state_dict()["h.1.mlp_proj.bias"]   stage 1's, never trained here
            dcp.save(get_model_state_dict(pm.module)) -> stage 1's weights of step 0 possibly
    after:  rank 0's state dict holds stage 0's parameters; rank 1's stage 1's (a tied weight
            both, the same values); dcp.save writes every weight as trained
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..protocol.groups import pipe_group
from .released import ReleasedParameter, _free, _released_forward


def release_other_stages(pm, module: torch.nn.Module, rows) -> None:
    """Release `module`'s parameters that another pipeline rank's stages hold and this rank's
    do not (a collective over the pipeline ranks: which FQNs each holds)."""
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
    owners, gone = {}, []
    for fqn, p in params:
        if fqn not in elsewhere or id(p) in kept or not p.numel() or \
                getattr(p, "_nnc_origin", None) is not None:
            continue
        p._nnc_elsewhere = True
        if p.untyped_storage().size():
            p.grad = None
            _free(p)
        if type(p) is torch.nn.Parameter:
            p.__class__ = ReleasedParameter
        owner = module.get_submodule(fqn.rpartition(".")[0])
        owners[id(owner)] = owner
        gone.append(fqn)
    for owner in owners.values():
        if not getattr(owner, "_nnc_stage_sd", False):
            owner._nnc_stage_sd = True
            owner.register_state_dict_pre_hook(_set_aside)
            owner.register_state_dict_post_hook(_put_back)
    if gone and not getattr(module, "_nnc_guard", False):
        module._nnc_guard = True
        module.register_forward_pre_hook(_released_forward(gone[0]))


def _set_aside(module, prefix: str, keep_vars: bool) -> None:
    """state_dict() leaves out the other stages' parameters (taken out of _parameters for
    the call, put back by _put_back)."""
    aside = {n: p for n, p in module._parameters.items()
             if getattr(p, "_nnc_elsewhere", False)}
    if aside:
        module.__dict__["_nnc_aside"] = (dict(module._parameters), aside)
        for n in aside:
            del module._parameters[n]


def _put_back(module, state_dict, prefix: str, local_metadata) -> None:
    stashed = module.__dict__.pop("_nnc_aside", None)
    if stashed is not None:
        module._parameters.clear()
        module._parameters.update(stashed[0])       # in their order


__all__ = ["release_other_stages"]
