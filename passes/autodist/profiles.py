"""Device profiles: what the cost model knows about the hardware.

Built-ins describe one accelerator of a common node (dense peak FLOP/s per dtype, memory
bandwidth and capacity, intra-node link, inter-node network). `parallel.device` picks one
by name or names a JSON file written by `measure_profile` (`python -m nncompile profile`),
which times this machine's matmuls, memory copies and (inside a process group) all-reduces.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError
from nncompile.fileio import write_json

GB = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops: dict = field(default_factory=dict)   # dtype name -> peak FLOP/s
    mem_bandwidth: float = 1e11                  # bytes/s
    mem_capacity_gb: float = 16.0
    intra_bandwidth: float = 1e10                # bytes/s per rank, one direction
    intra_latency: float = 1e-5                  # s per ring step
    inter_bandwidth: float = 1e9
    inter_latency: float = 2e-5
    devices_per_node: int = 8
    collective_overhead: float = 1e-5            # s per collective call (launch, sync)
    host_bandwidth: float | None = None          # bytes/s device <-> host memory (offload);
                                                 # None: HOST_BANDWIDTH[name], else 25 GB/s
    # measured by `python -m nncompile profile`; None: not modelled (the term is 0)
    op_overhead: float | None = None             # s per op call of generated code (forward)
    optimizer_tensor_s: float | None = None      # AdamW step: s per parameter tensor
    optimizer_element_s: float | None = None     # AdamW step: s per element
    op_efficiency: dict | None = None            # op name -> fraction of peak FLOP/s it
                                                 # reaches (e.g. attention); others: 1
    cores: int | None = None                     # CPU cores a node's ranks share (None: a
                                                 # device per rank)
    backend: str | None = None                   # "gloo": price the collectives gloo lacks as
                                                 # runtime/program/comm.py runs them (all_reduce+chunk)

    def peak_flops(self, dtype: torch.dtype) -> float:
        name = str(dtype).replace("torch.", "")
        return self.flops.get(name) or self.flops.get("float32") or 1e12

    def float8_flops(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s of float8 products (passes/float8.py): the profile's float8_e4m3fn
        entry, else twice bfloat16's on a GPU (float8 tensor cores), else `dtype`'s (a CPU
        emulates them in high precision)."""
        if self.flops.get("float8_e4m3fn"):
            return self.flops["float8_e4m3fn"]
        if "cpu" not in self.name.lower() and self.flops.get("bfloat16"):
            return 2 * self.flops["bfloat16"]
        return self.peak_flops(dtype)

    @property
    def host_bytes_per_s(self) -> float:
        """Bandwidth of copies between device and host memory (optimizer/parameter offload)."""
        return self.host_bandwidth or HOST_BANDWIDTH.get(self.name, DEFAULT_HOST_BANDWIDTH)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        for key in OPTIONAL:                    # unset: profiles written before they existed
            if out[key] is None:                # keep their JSON (and plan fingerprints)
                del out[key]
        return out


OPTIONAL = ("host_bandwidth", "op_overhead", "optimizer_tensor_s", "optimizer_element_s",
            "op_efficiency", "cores", "backend")


def _gpu(name, bf16, fp32, bw, cap, nvlink, net):
    return DeviceProfile(name, {"bfloat16": bf16, "float16": bf16, "float32": fp32},
                         mem_bandwidth=bw, mem_capacity_gb=cap, intra_bandwidth=nvlink,
                         intra_latency=5e-6, inter_bandwidth=net, inter_latency=1e-5,
                         devices_per_node=8, collective_overhead=1.5e-5)


# device <-> host copies when `host_bandwidth` is unset: PCIe 4.0 x16 (A100) and 5.0 x16 (H100,
# H200) in practice; on the 'cpu' profile "host" memory is the same memory: a memcpy (it reads
# and writes, so half of mem_bandwidth)
DEFAULT_HOST_BANDWIDTH = 25e9
HOST_BANDWIDTH = {"cpu": 5e9, "a100-80g": 25e9, "h100-80g": 50e9, "h200": 50e9}

BUILTIN: dict[str, DeviceProfile] = {
    # a 2-core CPU host running gloo over loopback
    "cpu": DeviceProfile("cpu", {"float32": 5e10, "bfloat16": 1e10, "float16": 5e9},
                         mem_bandwidth=1e10, mem_capacity_gb=16.0, intra_bandwidth=2e9,
                         intra_latency=3e-5, inter_bandwidth=1e9, inter_latency=5e-5,
                         devices_per_node=64, collective_overhead=1e-4),
    # SXM parts; fp32 without TF32 (PyTorch's default for matmuls)
    "a100-80g": _gpu("a100-80g", 312e12, 19.5e12, 2.039e12, 80.0, 300e9, 25e9),
    "h100-80g": _gpu("h100-80g", 989e12, 67e12, 3.35e12, 80.0, 450e9, 50e9),
    "h200": _gpu("h200", 989e12, 67e12, 4.8e12, 141.0, 450e9, 50e9),
    # this repository's 2-core machine (AMD EPYC, KVM, shared with other jobs) running gloo
    # ranks of one thread each: `torchrun --nproc_per_node=4 -m nncompile profile`, then fitted
    # to measured GPT step times (benchmarks/cost_model_accuracy.py --fit; docs/autodist.md)
    "cpu-gloo-2core": DeviceProfile(
        "cpu-gloo-2core", {"float32": 3.79e10, "bfloat16": 1.51e9, "float16": 1.23e9},
        mem_bandwidth=7.8e9, mem_capacity_gb=25.0, intra_bandwidth=3.53e8,
        intra_latency=1.28e-3, inter_bandwidth=1e9, inter_latency=5e-5, devices_per_node=64,
        collective_overhead=2.1e-5, host_bandwidth=1.25e9, op_overhead=7.5e-6,
        optimizer_tensor_s=5.2e-5, optimizer_element_s=2.93e-9,
        op_efficiency={"scaled_dot_product_attention": 0.19}, cores=2, backend="gloo"),
}


def default_device() -> str:
    """The built-in closest to this machine's accelerator, else 'cpu'."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for key, tag in (("h200", "h200"), ("h100", "h100-80g"), ("a100", "a100-80g")):
            if key in name:
                return tag
        return "h100-80g"
    return "cpu"


def cpu_fallback_note(device: str | DeviceProfile | None) -> str:
    """Why the plan is for the 'cpu' profile when nobody chose it: '' when parallel.device names a
    device or this machine has a GPU, else a sentence naming the fixes. Compiling on a laptop
    for a GPU cluster (parallelize(..., load_module=False)) otherwise plans for gloo links and
    the cpu profile's memory capacity without saying so."""
    if device or default_device() != "cpu":
        return ""
    gpus = ", ".join(f"'{name}'" for name in BUILTIN if not name.startswith("cpu"))
    return (f"no GPU is visible, so autodist plans for the built-in 'cpu' profile (gloo "
            f"links, {BUILTIN['cpu'].mem_capacity_gb:g} GB per rank). To compile for GPUs, name "
            f"the target: parallel={{\"device\": \"h100-80g\"}} (built-in GPU profiles: "
            f"{gpus}), or run `python -m nncompile profile -o FILE` on the target machine and "
            "pass parallel={\"device\": \"FILE\"}.")


def get_profile(device: str | DeviceProfile | None) -> DeviceProfile:
    if isinstance(device, DeviceProfile):
        return device
    device = device or default_device()
    if device in BUILTIN:
        return BUILTIN[device]
    path = Path(device)
    if path.suffix == ".json" and path.exists():
        data = json.loads(path.read_text())
        try:
            return DeviceProfile(**data)
        except TypeError as e:
            raise ConfigError(f"device profile {path} is malformed ({e}); write it again with "
                              "`python -m nncompile profile -o FILE`") from e
    raise ConfigError(f"parallel.device={device!r} is neither a built-in profile "
                      f"({sorted(BUILTIN)}) nor an existing .json profile file")


def _timeit(fn, repeat: int = 5, cpu_time: bool = True) -> float:
    """The fastest of `repeat` calls after one warm-up. On a CPU with one torch thread the
    clock is the thread's CPU time (`cpu_time`): other processes on a shared machine delay
    the call but do not count, so the profile is the machine's, not the moment's load."""
    fn()
    cuda = torch.cuda.is_available()
    clock = time.thread_time if cpu_time and not cuda and torch.get_num_threads() == 1 \
        else time.perf_counter
    best = float("inf")
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t = clock()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, clock() - t)
    return best


def _train_time(fn, *inputs) -> float:
    """Seconds of forward and backward of `fn(*inputs)` (inputs need a gradient)."""
    out = fn(*inputs)
    grad = torch.ones_like(out)
    return _timeit(lambda: fn(*inputs).backward(grad), 7)


def _matmul_flops(dev: str, dtype: torch.dtype, size: int) -> float:
    """FLOP/s of a linear's forward and backward (3 x 2 size^3: y, dX, dW), the way the cost
    model prices a matmul in training (3 x its forward)."""
    x = torch.randn(size, size, device=dev, dtype=dtype, requires_grad=True)
    w = torch.randn(size, size, device=dev, dtype=dtype, requires_grad=True)
    return 3 * 2 * size ** 3 / _train_time(torch.nn.functional.linear, x, w)


def _attention_efficiency(dev: str, size: int, peak: float) -> float:
    """Causal scaled_dot_product_attention's forward + backward FLOP/s (heads of 64, a
    sequence of size / 2, 32 batch x heads) as a fraction of the matmul's."""
    q, k, v = (torch.randn(32, size // 2, 64, device=dev, requires_grad=True) for _ in range(3))
    secs = _train_time(lambda *a: torch.nn.functional.scaled_dot_product_attention(
        *a, is_causal=True), q, k, v)
    return min(1.0, 3 * 4.0 * q.numel() * (size // 2) * 0.5 / secs / peak)


def _elementwise_bandwidth(dev: str, rows: int = 4096) -> float:
    """Bytes/s that add, gelu and layer_norm move in forward and backward (3 x the forward's
    inputs + outputs, as the cost model counts them) on activation-sized tensors (4 MB): what
    its bytes / mem_bandwidth prices. A large copy is another number (page faults, no cache):
    see host_bandwidth."""
    f = torch.nn.functional
    x = torch.randn(rows, 256, device=dev, requires_grad=True)
    y = torch.randn_like(x, requires_grad=True)
    w = torch.ones(256, device=dev, requires_grad=True)
    b = torch.zeros(256, device=dev, requires_grad=True)
    secs = _train_time(torch.add, x, y) + _train_time(f.gelu, x) \
        + _train_time(lambda *a: f.layer_norm(a[0], [256], *a[1:]), x, w, b)
    return 3 * (3 + 2 + 2) * x.numel() * 4 / secs


def _op_overhead(dev: str) -> float:
    """Seconds per op call of generated code, forward-equivalent: a chain of 200 aten calls
    on a tiny tensor, forward and backward, divided by 3 x 200 (the cost model's training
    factor is 3)."""
    x = torch.ones(4, device=dev, requires_grad=True)
    mul, reshape = torch.ops.aten.mul.Tensor, torch.ops.aten.reshape.default

    def chain():
        v = x
        for _ in range(100):
            v = reshape(mul(v, 1.0001), [4])
        v.sum().backward()
    return _timeit(chain, 9) / 600


def _optimizer_times(dev: str, big: int = 4 * 2 ** 20) -> tuple[float, float]:
    """AdamW's step (torch.optim defaults): seconds per parameter tensor (64 tiny ones) and
    per element (one `big`-element tensor, less one tensor's time)."""
    def step_time(numel: int, count: int) -> float:
        params = [torch.nn.Parameter(torch.randn(numel, device=dev)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params)
        return _timeit(opt.step, 5)
    per_tensor = step_time(16, 64) / 64
    return per_tensor, max(step_time(big, 1) - per_tensor, 0.0) / big


def _fit_links(points: list[tuple[int, float, float]]) -> dict:
    """collective_overhead o, intra_latency a, intra_bandwidth bw from all-reduce timings
    (group size g, bytes B, seconds t): least squares of t = o + 2 (g-1) a + 2 (g-1)/g B / bw,
    with a = 0 when only one group size was timed (or the fit makes it negative)."""
    import numpy as np
    t = np.array([p[2] for p in points])
    ring = np.array([2 * (g - 1) / g * b for g, b, _ in points])
    lat = np.array([2 * (g - 1) for g, _, _ in points], dtype=float)
    cols = [np.ones_like(t), ring] + ([lat] if len(set(lat)) > 1 else [])
    coef = np.linalg.lstsq(np.stack(cols, 1), t, rcond=None)[0]
    if len(coef) == 3 and coef[2] < 0:
        coef = np.linalg.lstsq(np.stack(cols[:2], 1), t, rcond=None)[0]
    o, inv_bw = float(coef[0]), float(coef[1])
    alpha = float(coef[2]) if len(coef) == 3 else 0.0
    return {"collective_overhead": max(o, 1e-6), "intra_latency": alpha,
            "intra_bandwidth": 1.0 / inv_bw if inv_bw > 0 else 1e12}


def _measure_links(dev: str) -> dict:
    """All-reduce timings over the whole job and (more than 2 ranks) over pairs of ranks, all
    pairs at once, at 4 B to 4 MB; fitted by _fit_links."""
    n = dist.get_world_size()
    groups = [(None, n)]
    if n > 2 and n % 2 == 0:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, n, 2)]
        groups.append((pairs[dist.get_rank() // 2], 2))
    points = []
    for group, g in groups:
        for numel in (1, 2 ** 12, 2 ** 16, 2 ** 18, 2 ** 20):
            x = torch.ones(numel, device=dev)
            dist.barrier()
            t = _timeit(lambda: dist.all_reduce(x, group=group), 7, cpu_time=False)
            box = [t]
            dist.broadcast_object_list(box, src=0)       # rank 0's timing for everyone
            points.append((g, numel * 4, box[0]))
    return _fit_links(points)


def measure_profile(name: str = "measured", size: int | None = None) -> DeviceProfile:
    """Time this machine for the cost model: a linear's forward + backward per dtype (peak
    FLOP/s), causal attention's (its efficiency against that), element-wise ops on
    activation-sized tensors (mem_bandwidth), the call overhead of an op, AdamW's step, a
    large copy (the host bandwidth of offloading) and, inside a process group, all-reduces
    (fitted to overhead, latency per ring step and bandwidth). Links not measured keep the
    closest built-in's values.

    Under torchrun, compute is timed on as many ranks at once as the machine has cores (the
    others wait), so it is a rank's speed while its neighbours compute too; on a CPU the
    profile records `cores`, and the cost model stretches compute when more ranks than that
    share a node. Collectives are timed with every rank. Runs with torch's thread count as it
    is (torchrun sets OMP_NUM_THREADS=1)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    size = size or (4096 if dev == "cuda" else 512)
    base = BUILTIN[default_device()]
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    cores = len(os.sched_getaffinity(0)) if dev == "cpu" and hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() if dev == "cpu" else None)
    if distributed:
        dist.barrier()
    compute = None
    if dev == "cuda" or rank < (cores or 1):
        compute = _measure_compute(dev, size)
    if distributed:
        dist.barrier()
        box = [compute]
        dist.broadcast_object_list(box, src=0)
        compute = box[0]
    link = _measure_links(dev) if distributed else {}
    if dev == "cuda":
        capacity = torch.cuda.get_device_properties(0).total_memory / GB
    else:
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    return dataclasses.replace(base, name=name, mem_capacity_gb=capacity, cores=cores,
                               backend=("gloo" if distributed and dist.get_backend() == "gloo"
                                        else None), **compute, **link)


def _measure_compute(dev: str, size: int) -> dict:
    flops = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        try:
            n = size if dev == "cuda" or dtype == torch.float32 else min(size, 256)
            flops[str(dtype).replace("torch.", "")] = _matmul_flops(dev, dtype, n)
        except RuntimeError:
            continue
    scale = max(1, (512 // size) ** 2)        # a small `size` (tests) shrinks every tensor
    x = torch.empty(16 * 2 ** 20 // scale, device=dev)
    host = x.numel() * 4 / _timeit(lambda: x.clone())   # on a CPU "host" memory is this
    if dev == "cuda":                                     # memory: a memcpy; on a GPU a
        pinned = torch.empty(x.numel(), pin_memory=True)  # pinned host -> device copy
        host = x.numel() * 4 / _timeit(lambda: x.copy_(pinned, non_blocking=True))
    per_tensor, per_element = _optimizer_times(dev, 4 * 2 ** 20 // scale)
    return {"flops": flops, "mem_bandwidth": _elementwise_bandwidth(dev, 4096 // scale),
            "host_bandwidth": host, "op_overhead": _op_overhead(dev),
            "optimizer_tensor_s": per_tensor, "optimizer_element_s": per_element,
            "op_efficiency": {"scaled_dot_product_attention": _attention_efficiency(
                dev, size, flops["float32"])}}


def save_profile(profile: DeviceProfile, path: str | Path) -> Path:
    path = Path(path)
    write_json(path, profile.to_json())
    return path
