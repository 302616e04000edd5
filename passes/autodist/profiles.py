"""Device profiles: what the cost model knows about the hardware.

Built-ins describe one accelerator of a common node (dense peak FLOP/s per dtype, memory
bandwidth and capacity, intra-node link, inter-node network). `pas_config["device"]` picks one
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

    def peak_flops(self, dtype: torch.dtype) -> float:
        name = str(dtype).replace("torch.", "")
        return self.flops.get(name) or self.flops.get("float32") or 1e12

    @property
    def host_bytes_per_s(self) -> float:
        """Bandwidth of copies between device and host memory (optimizer/parameter offload)."""
        return self.host_bandwidth or HOST_BANDWIDTH.get(self.name, DEFAULT_HOST_BANDWIDTH)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        if out["host_bandwidth"] is None:       # unset: profiles written before it existed
            del out["host_bandwidth"]           # keep their JSON (and plan fingerprints)
        return out


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
    """Why the plan is for the 'cpu' profile when nobody chose it: '' when pas_config names a
    device or this machine has a GPU, else a sentence naming the fixes. Compiling on a laptop
    for a GPU cluster (parallelize(..., load_module=False)) otherwise plans for gloo links and
    the cpu profile's memory capacity without saying so."""
    if device or default_device() != "cpu":
        return ""
    gpus = ", ".join(f"'{name}'" for name in BUILTIN if name != "cpu")
    return (f"no GPU is visible, so autodist plans for the built-in 'cpu' profile (gloo "
            f"links, {BUILTIN['cpu'].mem_capacity_gb:g} GB per rank). To compile for GPUs, name "
            f"the target: pas_config={{\"device\": \"h100-80g\"}} (built-in GPU profiles: "
            f"{gpus}), or run `python -m nncompile profile -o FILE` on the target machine and "
            "pass pas_config={\"device\": \"FILE\"}.")


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
    raise ConfigError(f"pas_config device={device!r} is neither a built-in profile "
                      f"({sorted(BUILTIN)}) nor an existing .json profile file")


def _timeit(fn, repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def measure_profile(name: str = "measured", size: int | None = None) -> DeviceProfile:
    """Time matmuls per dtype, a large copy and (inside a process group) an all-reduce on the
    current device; links not measured keep the closest built-in's values."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    size = size or (4096 if dev == "cuda" else 512)
    base = BUILTIN[default_device()]
    flops = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.randn(size, size, device=dev, dtype=dtype)
        try:
            secs = _timeit(lambda: a @ a)
        except RuntimeError:
            continue
        flops[str(dtype).replace("torch.", "")] = 2 * size ** 3 / secs
    x = torch.empty(64 * 2 ** 20 // 4, device=dev)
    bandwidth = 2 * x.numel() * 4 / _timeit(lambda: x.clone())
    if dev == "cuda":
        capacity = torch.cuda.get_device_properties(0).total_memory / GB
    else:
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    host = bandwidth / 2                  # on a CPU "host" memory is this memory: a memcpy
    if dev == "cuda":                     # pinned host -> device copy
        pinned = torch.empty(x.numel(), pin_memory=True)
        host = x.numel() * 4 / _timeit(lambda: x.copy_(pinned, non_blocking=True))
    link = {}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        n = dist.get_world_size()
        big = torch.ones(16 * 2 ** 20 // 4, device=dev)
        small = torch.ones(1, device=dev)
        t_small = _timeit(lambda: dist.all_reduce(small))
        t_big = _timeit(lambda: dist.all_reduce(big))
        link = {"collective_overhead": t_small,
                "intra_bandwidth": 2 * (n - 1) / n * big.numel() * 4 / max(t_big - t_small,
                                                                            1e-9)}
    return dataclasses.replace(base, name=name, flops=flops, mem_bandwidth=bandwidth,
                               mem_capacity_gb=capacity, host_bandwidth=host, **link)


def save_profile(profile: DeviceProfile, path: str | Path) -> Path:
    path = Path(path)
    write_json(path, profile.to_json())
    return path
