"""nncompile.compat: the one module that knows torch versions (docs/versions.md).

- importing nncompile on a torch older than compat.MIN_TORCH is an ImportError naming the
  minimum;
- no file of the package outside compat.py tests the torch version or uses a private torch API
  that is not in ALLOWED below (each a version-stable use, with why);
- the threaded process group (nncompile.tools.simulate) leaves autograd and the default world as
  they were;
- a Hugging Face LayerDrop of 0 traces (transformers 5.0-5.19 branch on a random draw in
  training), one > 0 in training is a TraceError naming the fix.
"""
from __future__ import annotations

import ast
from pathlib import Path
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import nncompile
from nncompile import compat
from nncompile.errors import TraceError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIRS = ("nncompile", "runtime", "passes", "integration")

# Private torch names used outside compat.py, each stable across the supported releases (the
# suite runs them on the oldest and the newest: docs/versions.md). A new private use goes
# through compat.py with a comment naming the release that changed it, or here with why.
ALLOWED = {
    "torch._ops": "OpOverload / HigherOrderOperator: the classes of torch.ops.* (every release)",
    "torch.utils._pytree": "pytree (tree_map, treespec_dumps): used across torch, stable",
    "torch._subclasses.fake_tensor": "FakeTensorMode: shape propagation without data",
    "torch._utils": "_flatten_dense_tensors: the bucket flattening DDP itself uses",
    "torch.distributed._functional_collectives": "traceable collectives (torch.compile)",
    "torch.distributed.checkpoint._traverse": "set_element: DCP's own state-dict walker",
    "torch.distributed.distributed_c10d._get_default_group": "the default group object",
    "torch.distributed.pipelining.microbatch._Replicate": "the replicate chunk spec",
    "torch.testing._internal.common_methods_invocations": "op_db: the op-rule checker's samples",
    "torch.autograd.Variable._execution_engine": "queue_callback: end-of-backward hook, as DDP",
    "torch._amp_foreach_non_finite_check_and_unscale_": "what GradScaler.unscale_ calls",
    "torch.amp.GradScaler._unscale_grads_": "routed so scaled gradients of shards agree",
    "torch.amp.grad_scaler._MultiDeviceReplicator": "the scale per device, as GradScaler has it",
    "torch.cuda.memory._record_memory_history": "the documented memory-snapshot API",
    "torch.cuda.memory._dump_snapshot": "the documented memory-snapshot API",
    "torch._C._profiler": "_EventType of profiler events (memory timeline)",
    "torch.profiler._memory_profiler": "the memory profiler's categories (memory timeline)",
    "torch._functorch": "unwrap_dead_wrappers, looked up with getattr (function_watch)",
}
# modules imported under another name in the package
ALIASES = {"dist": "torch.distributed", "ckpt": "torch.utils.checkpoint",
           "funcol": "torch.distributed._functional_collectives", "pytree": "torch.utils._pytree"}
VERSION_WORDS = ("TorchVersion", "packaging")       # besides torch.__version__ itself


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(ALIASES.get(node.id, node.id))
    return ".".join(reversed(parts))


def _private(name: str) -> str | None:
    """The name up to its first private part, where it is torch's and private."""
    if not name.startswith("torch"):
        return None
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.startswith("_") and not p.startswith("__"):
            return ".".join(parts[:i + 1])
    return None


def _uses(path: str):
    """(line, private torch name or version word) for each use in one file."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                hit = _private(f"{node.module}.{a.name}")
                if hit:
                    yield node.lineno, hit
        elif isinstance(node, ast.Import):
            for a in node.names:
                hit = _private(a.name)
                if hit:
                    yield node.lineno, hit
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            hit = name and _private(name)
            if hit and not name.startswith("torch.ops."):
                yield node.lineno, hit
            if name in ("torch.__version__", "torch.version.__version__") or \
                    (name or "").endswith("compat.torch_version"):
                yield node.lineno, name
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "getattr" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            base = _dotted(node.args[0])
            hit = base and _private(f"{base}.{node.args[1].value}")
            if hit:
                yield node.lineno, hit
        elif isinstance(node, ast.Name) and node.id in VERSION_WORDS:
            yield node.lineno, node.id


def _package_uses():
    for d in PACKAGE_DIRS:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            for f in files:
                if f.endswith(".py") and f != "compat.py":
                    path = os.path.join(base, f)
                    for line, name in _uses(path):
                        yield os.path.relpath(path, ROOT), line, name


def _is_allowed(path: str, name: str) -> bool:
    if name == "torch.__version__" and path == os.path.join("nncompile", "tools", "memory.py"):
        return True                 # recorded in a memory profile, not compared
    return any(name == k or name.startswith(k + ".") or k.startswith(name + ".")
               for k in ALLOWED)


def test_no_version_checks_or_private_torch_outside_compat():
    bad = [f"{p}:{line}: {name}" for p, line, name in _package_uses() if not _is_allowed(p, name)]
    assert not bad, ("version checks / private torch APIs outside nncompile/compat.py (route "
                     "them through compat, or add a version-stable one to ALLOWED with why):\n"
                     + "\n".join(bad))


def test_the_grep_sees_what_it_guards(tmp_path):
    """The scan above finds each kind of use it forbids (else it could never fail)."""
    src = tmp_path / "x.py"
    src.write_text("import torch\nimport torch.distributed as dist\n"
                   "from torch.testing._internal.distributed import multi_threaded_pg\n"
                   "if torch.__version__ >= '2.12': pass\n"
                   "f = getattr(torch._C, '_will_engine_execute_node', None)\n"
                   "dist.distributed_c10d._world.comms\n"
                   "if compat.torch_version() < (2, 13): pass\n")
    names = {n for _, n in _uses(str(src))}
    assert {"torch.testing._internal", "torch.__version__", "torch._C",
            "torch.distributed.distributed_c10d._world", "compat.torch_version"} <= names, names
    assert not _is_allowed("nncompile/x.py", "torch.testing._internal.distributed")
    assert not _is_allowed("nncompile/x.py", "torch.__version__")


def test_older_torch_is_an_import_error_naming_the_minimum(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.1+cpu")
    with pytest.raises(ImportError, match=r"torch>=2\.11, found torch 2\.10\.1"):
        compat.check_torch_version()
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    compat.check_torch_version()
    assert compat.torch_version("2.15.0") == (2, 15)


def test_importing_nncompile_checks_the_version():
    code = ("import torch; torch.__version__ = '2.9.0'\n"
            "try:\n    import nncompile\nexcept ImportError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert "refused: nncompile needs torch>=2.11, found torch 2.9.0" in out.stdout, \
        out.stdout + out.stderr


def test_threaded_group_leaves_the_process_as_it_was():
    from nncompile.tools.simulate import run_ranks
    world = dist.distributed_c10d._world

    def fn(rank):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return float(t)

    assert run_ranks(2, fn) == [3.0, 3.0]
    assert dist.distributed_c10d._world is world
    assert torch._C._is_multithreading_enabled()
    assert not dist.is_initialized()


def _gloo_threads() -> int:
    task = f"/proc/{os.getpid()}/task"
    names = []
    for t in os.listdir(task):
        try:
            names.append(open(f"{task}/{t}/comm").read().strip())
        except OSError:             # the thread ended meanwhile
            pass
    return sum(n.startswith("gloo") for n in names)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads from /proc")
def test_simulated_jobs_leave_no_groups_or_threads_behind(tmp_path):
    """Each simulated job's lockstep groups are threaded ones (a gloo group has polling
    threads of its own), and destroy_process_group drops what the runtime cached for the job:
    jobs run one after another do not pile them up."""
    import models
    from nncompile.runtime.protocol import groups, lockstep
    from nncompile.runtime.store import dtensors
    from nncompile.tools.simulate import run_ranks

    def fn(rank):
        pm = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                                   nncompile.ComputeConfig(2, 2), pas_policy="tp",
                                   gen_savedir=str(tmp_path))
        pm(**models.batch("gpt", 0)).backward()
        kept.append(pm)             # modules that outlive their job (a test's fixtures)
        return len(groups._CACHE[dist.distributed_c10d._get_default_group()])

    before, seen, kept = _gloo_threads(), [], []
    for _ in range(2):
        seen += run_ranks(2, fn)
    assert all(n > 0 for n in seen)                 # the jobs did cache groups
    assert len(groups._CACHE) == len(lockstep._MODULES) == len(dtensors._MESHES) == 0
    assert _gloo_threads() == before


def test_traces_in_successive_simulated_ranks_with_no_gpu_visible():
    """Each run_ranks traces on a fresh thread; with no GPU visible, FakeTensorMode's no-op
    CUDA device guard set by one thread must outlive it (torch 2.11's CUDA build crashed the
    process on the second trace). In a child process: a crash must not take the suite down."""
    code = (
        "import torch\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "from nncompile.tools.simulate import run_ranks\n"
        "def fn(rank):\n"
        "    with FakeTensorMode() as mode:\n"
        "        return tuple((torch.ones(2, 3) @ torch.ones(3, 4)).shape)\n"
        "for _ in range(3):\n"
        "    assert run_ranks(2, fn) == [(2, 4), (2, 4)]\n"
        "print('traced 3 times')\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and "traced 3 times" in out.stdout, out.stdout + out.stderr


class _LayerDropStack(torch.nn.Module):
    """Hugging Face's LayerDrop as transformers 5.0-5.19 write it (BART, mBART, Whisper)."""

    def __init__(self, layerdrop: float):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.layerdrop = layerdrop

    def forward(self, x):
        for layer in self.layers:
            to_drop = False
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    to_drop = True
            if not to_drop:
                x = layer(x)
        return x.sum()


def test_layerdrop_zero_traces_and_keeps_its_value():
    from nncompile.frontend import trace
    model = _LayerDropStack(0.0).train()
    graph = trace(model, (torch.randn(4, 8),))
    assert sum(op.target_name.endswith("linear.default") or "addmm" in op.target_name
               or "linear" in op.target_name for op in graph.ops) >= 2
    assert model.layerdrop == 0.0 and type(model.layerdrop) is float


def test_layerdrop_in_training_is_refused_with_the_fix():
    from nncompile.frontend import trace
    with pytest.raises(TraceError, match="layerdrop=0.2.*encoder_layerdrop"):
        trace(_LayerDropStack(0.2).train(), (torch.randn(4, 8),))


def test_hf_bart_traces_under_this_transformers(tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import models
    model = models.build("hf_bart")
    pm = nncompile.parallelize(model, models.batch("hf_bart", 0), nncompile.ComputeConfig(1),
                               gen_savedir=tmp_path, load_module=False)
    assert pm is not None


@pytest.mark.parametrize("plan", [1, 2])
def test_hf_bart_with_layerdrop_compiles_for_eval_and_refuses_training(tmp_path, plan):
    """BART with encoder/decoder layerdrop 0.3 handed over in eval mode (evaluation): its eval
    program is compiled and equals the model's eval loss; training mode is refused with the
    fix. Handed over in training mode, the layerdrop is refused at compile time."""
    pytest.importorskip("transformers")
    import copy
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import models
    from nncompile.tools.simulate import run_ranks
    torch.manual_seed(0)
    model = models.hf_bart(layerdrop=0.3).eval()
    batch = models.batch("hf_bart", 0)
    with torch.no_grad():
        want = float(model(**batch))

    def fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), batch, nncompile.ComputeConfig(plan, plan),
                                   pas_policy="tp", gen_savedir=tmp_path,
                                   instance_name="bart_eval")
        assert not pm.training
        with torch.no_grad():
            got = float(pm(**batch))
        pm.train()
        with pytest.raises(nncompile.ConfigError,
                           match=r"training mode.*layerdrop=0\.3.*call pm\.eval\(\)"):
            pm(**batch)
        return got

    for got in run_ranks(plan, fn):
        assert got == pytest.approx(want, rel=1e-5)
    with pytest.raises(TraceError, match="layerdrop=0.3"):
        nncompile.parallelize(model.train(), batch, nncompile.ComputeConfig(1),
                              gen_savedir=tmp_path / "train", load_module=False)


class _Branchy(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:             # data-dependent: torch.export raises
            return x * 2
        return x


def test_a_failed_trace_leaves_no_global_module_hooks():
    """torch 2.11's export leaves a global buffer-registration hook behind when it raises;
    later traces would then see a global module hook (layer replay turns itself off)."""
    from torch.nn.modules import module as nn_module
    from nncompile.frontend import trace
    before = dict(nn_module._global_buffer_registration_hooks)
    with pytest.raises(TraceError, match="branches on a tensor's value"):
        trace(_Branchy(), (torch.randn(4),))
    assert dict(nn_module._global_buffer_registration_hooks) == before


def test_the_torch_functions_nncompile_replaces_are_the_documented_ones():
    """After `import nncompile`, the torch functions it replaced (compat.wrap_once marks each)
    are exactly those docs/concepts.md lists with the torch behaviour that forces them;
    `destroy_process_group`, `add_param_group` and `zero_grad` stay torch's own."""
    from torch.nn.utils import clip_grad
    candidates = {"torch.distributed.destroy_process_group": dist.destroy_process_group,
                  "Optimizer.add_param_group": torch.optim.Optimizer.add_param_group,
                  "Optimizer.zero_grad": torch.optim.Optimizer.zero_grad,
                  "Optimizer.step": torch.optim.Optimizer.step,
                  "torch.nn.utils.clip_grad_norm_": clip_grad.clip_grad_norm_,
                  "torch.nn.utils.get_total_norm": torch.nn.utils.get_total_norm,
                  "GradScaler._unscale_grads_": torch.amp.GradScaler._unscale_grads_}
    replaced = {name for name, fn in candidates.items() if getattr(fn, "_nncompile", False)}
    assert replaced == {"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.get_total_norm",
                        "GradScaler._unscale_grads_"}, replaced
    table = (Path(ROOT) / "docs" / "concepts.md").read_text().split(
        "What nncompile still puts into torch")[1].split("\n\n")[1]
    for name in ("clip_grad_norm_", "get_total_norm", "GradScaler._unscale_grads_"):
        assert name in table, name
    assert "destroy_process_group" not in table
