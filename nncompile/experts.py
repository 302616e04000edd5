"""The experts of a mixture-of-experts layer as one op: `nncompile_moe::experts_mlp` (a
namespace of its own: `nncompile::` holds the ops users register with register_op).

Hugging Face's batched experts (Mixtral, Qwen3-MoE, DeepSeek-V3: `@use_experts_implementation`,
"grouped_mm") sort the token copies by expert and run every expert's gated MLP as two grouped
matrix products over row ranges, `offs` holding each expert's last row + 1:

    h = grouped_mm(x, w_in, offs)        # x: [S, H] sorted rows, w_in: [E, H, 2I]
    a, b = h.split(I, -1)
    y = grouped_mm(act(a) * b, w_out, offs)   # w_out: [E, I, H2] -> y: [S, H2]

`experts_mlp(x, w_in, w_out, offs, gmm, act)` computes exactly that (the same grouped_mm op,
named by `gmm`, the same activation), so passes/fuse_experts.py can put it in place of the
five ops, and one rule (nncompile/rules/experts.py) can split its experts: rank r of n holds
experts [r E/n, (r+1) E/n), computes their rows and leaves zeros elsewhere, a partial sum
(runtime/comm.py `local_experts`). Autograd runs through the ops it calls.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}

torch.library.define(
    "nncompile_moe::experts_mlp",
    "(Tensor x, Tensor w_in, Tensor w_out, Tensor offs, str gmm, str act) -> Tensor")


def grouped_mm(name: str):
    """The grouped matrix product op `name` ('aten::_grouped_mm',
    'transformers::grouped_mm_fallback')."""
    namespace, op = name.split("::")
    if namespace == "transformers":
        import transformers.integrations.moe  # noqa: F401  (registers its ops)
    return getattr(getattr(torch.ops, namespace), op).default


@torch.library.impl("nncompile_moe::experts_mlp", "CompositeImplicitAutograd")
def _experts_mlp(x, w_in, w_out, offs, gmm: str, act: str):
    mm = grouped_mm(gmm)
    h = mm(x, w_in, offs)
    a, b = h.split(h.shape[-1] // 2, dim=-1)
    return mm(ACTIVATIONS[act](a) * b, w_out, offs)


EXPERTS_MLP = torch.ops.nncompile_moe.experts_mlp.default

__all__ = ["EXPERTS_MLP", "ACTIVATIONS", "grouped_mm"]
