"""The experts of a mixture-of-experts layer as one op, in two granularities (a namespace of
their own: `nncompile::` holds the ops users register with register_op).

`nncompile_moe::moe_experts(x, top_k_index, top_k_weights, w_in, w_out, act, transposed)`
is a whole experts module of Hugging Face's interface (Mixtral, Qwen3-MoE, DeepSeek-V3,
`@use_experts_implementation`): token t's output is the sum over its k picks of
`top_k_weights[t, j] * expert_e(x[t])`, e = top_k_index[t, j], each expert a gated MLP:

    a, b = (x @ w_in[e].T).chunk(2, -1)      # w_in: [E, 2I, H]  (transposed: [E, H, 2I])
    expert_e(x) = (act(a) * b) @ w_out[e].T   # w_out: [E, H, I]  (transposed: [E, I, H])

Indices outside [0, E) pick nothing. Because it is token-wise in x, top_k_index and
top_k_weights, its rule (nncompile/rules/experts.py) can split the tokens as well as the
experts; runtime/program/experts.py computes the pieces (the rows of some experts, and the
all-to-all dispatch between ranks holding different tokens). `experts_forms(module)` finds
the submodules that compute it, checked on random inputs against their own forward.

`nncompile_moe::experts_mlp(x, w_in, w_out, offs, gmm, act)` is the expert products alone
over token copies already sorted by expert, as a custom MoE that calls grouped_mm traces
(passes/fuse_experts.py); its rule splits the experts only.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nncompile import compat

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}

torch.library.define(
    "nncompile_moe::experts_mlp",
    "(Tensor x, Tensor w_in, Tensor w_out, Tensor offs, str gmm, str act) -> Tensor")
torch.library.define(
    "nncompile_moe::moe_experts",
    "(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor w_in, Tensor w_out, str act, "
    "bool transposed) -> Tensor")


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


def _grouped_ok(x: torch.Tensor) -> bool:
    """The grouped product runs here: bfloat16 on a CUDA device of compute capability 9+."""
    return (compat.grouped_mm() is not None and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def expert_rows(xs, experts, w_in, w_out, act: str, transposed: bool):
    """Row i of `xs` through expert `experts[i]` (0 .. len(w_in) - 1: these weights' own
    experts): one grouped product per projection where torch offers it (_grouped_ok), else
    one product per expert. Every expert's weights take part, with no rows too, so each has
    a gradient (zeros when it got no token)."""
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=w_in.shape[0])
    xs = xs[order]
    win = w_in if transposed else w_in.transpose(-2, -1)        # [E, H, 2I]
    wout = w_out if transposed else w_out.transpose(-2, -1)     # [E, I, H]
    f = ACTIVATIONS[act]
    if _grouped_ok(xs) and xs.shape[0]:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        mm = compat.grouped_mm()
        a, b = mm(xs, win, offs=offs).chunk(2, dim=-1)
        y = mm((f(a) * b).contiguous(), wout, offs=offs)
    else:
        pieces, start = [], 0
        for e, c in enumerate(counts.tolist()):
            a, b = (xs[start:start + c] @ win[e]).chunk(2, dim=-1)
            pieces.append((f(a) * b) @ wout[e])
            start += c
        y = torch.cat(pieces)
    return torch.zeros_like(y).index_copy(0, order, y)


def routed_sum(x, top_k_index, top_k_weights, w_in, w_out, act: str, transposed: bool,
               first: int = 0):
    """moe_experts over the experts first .. first + len(w_in) - 1 only (w_in, w_out: theirs):
    each token's weighted sum over its picks among them, zeros for the rest."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    picks = ((flat >= first) & (flat < first + w_in.shape[0])).nonzero().squeeze(1)
    rows = picks // k
    y = expert_rows(x[rows], flat[picks] - first, w_in, w_out, act, transposed)
    y = y * top_k_weights.reshape(-1)[picks].unsqueeze(-1).to(y.dtype)
    return x.new_zeros(x.shape[0], y.shape[-1]).index_add(0, rows, y.to(x.dtype))


@torch.library.impl("nncompile_moe::moe_experts", "CompositeImplicitAutograd")
def _moe_experts(x, top_k_index, top_k_weights, w_in, w_out, act: str, transposed: bool):
    return routed_sum(x, top_k_index, top_k_weights, w_in, w_out, act, transposed)


EXPERTS_MLP = torch.ops.nncompile_moe.experts_mlp.default
MOE_EXPERTS = torch.ops.nncompile_moe.moe_experts.default


@dataclass(frozen=True)
class ExpertsForm:
    """How one experts module computes (moe_experts' string and bool arguments)."""
    act: str
    transposed: bool


INTERFACE = ("hidden_states", "top_k_index", "top_k_weights")
WEIGHTS = ("gate_up_proj", "down_proj")


def experts_forms(module: torch.nn.Module) -> dict[str, ExpertsForm]:
    """{FQN: form} of `module`'s submodules that compute moe_experts: Hugging Face's experts
    interface (forward(hidden_states, top_k_index, top_k_weights), parameters gate_up_proj
    [E, 2I, H] and down_proj [E, H, I], or both transposed, and no other parameter or
    buffer), confirmed by calling the module's own forward on random tokens and weights
    (once per class and shapes) and comparing with moe_experts for each activation. A
    module that computes anything else is left out and runs as traced."""
    out, seen = {}, {}
    for name, sub in module.named_modules():
        shapes = _interface_shapes(sub)
        if shapes is None:
            continue
        key = (type(sub), shapes, type(getattr(sub, "act_fn", None)))
        if key not in seen:
            seen[key] = _form_of(sub, shapes)
        if seen[key] is not None:
            out[name] = seen[key]
        else:
            from nncompile.log import log
            log(f"{name} ({type(sub).__name__}) has the experts interface but does not compute "
                "moe_experts (docs/experts.md: a custom MoE); it runs as traced")
    return out


def _interface_shapes(sub: torch.nn.Module):
    params = dict(sub.named_parameters())          # its children's too: none allowed
    if set(params) != set(WEIGHTS) or any(True for _ in sub.buffers()):
        return None
    try:
        names = list(inspect.signature(sub.forward).parameters)
    except (TypeError, ValueError):
        return None
    w_in, w_out = params["gate_up_proj"], params["down_proj"]
    if names[:3] != list(INTERFACE) or w_in.dim() != 3 or w_out.dim() != 3 or \
            w_in.shape[0] != w_out.shape[0]:
        return None
    return tuple(w_in.shape), tuple(w_out.shape)


def _form_of(sub: torch.nn.Module, shapes) -> ExpertsForm | None:
    (e, a, b), (_, c, d) = shapes
    layouts = [t for t, ok in ((False, a == 2 * d and b == c), (True, b == 2 * c and a == d))
               if ok]
    if not layouts:
        return None
    g = torch.Generator().manual_seed(0)
    hidden = b if not layouts[0] else a
    tokens, k = 2 * e + 3, min(2, e)
    dtype = torch.float32         # what every grouped product accepts
    w = {"gate_up_proj": torch.randn(shapes[0], generator=g, dtype=dtype) / hidden ** 0.5,
         "down_proj": torch.randn(shapes[1], generator=g, dtype=dtype) / hidden ** 0.5}
    x = torch.randn(tokens, hidden, generator=g, dtype=dtype)
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g, dtype=dtype)
    try:
        with torch.no_grad():
            want = torch.func.functional_call(sub, w, (x, index, weights))
    except Exception:      # noqa: BLE001  (a forward that cannot run on CPU float32 here)
        return None
    if not isinstance(want, torch.Tensor) or want.shape != x.shape:
        return None
    for transposed in layouts:
        for act in ACTIVATIONS:
            got = routed_sum(x, index, weights, w["gate_up_proj"], w["down_proj"], act,
                             transposed)
            if torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                return ExpertsForm(act, transposed)
    return None


__all__ = ["EXPERTS_MLP", "MOE_EXPERTS", "ACTIVATIONS", "ExpertsForm", "experts_forms",
           "expert_rows", "routed_sum", "grouped_mm"]
