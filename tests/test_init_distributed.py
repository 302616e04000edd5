"""init_distributed with NCCL: a local rank without its GPU (torchrun --nproc_per_node=2 on a
one-GPU machine) raises a ConfigError that says how many GPUs the process sees, which local
rank asked for which GPU and what to do, before CUDA's raw "invalid device ordinal"; a local
rank with its GPU goes on to set_device and init_process_group. CUDA is faked (no GPU
needed)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import nncompile
from nncompile import ConfigError


@pytest.fixture
def fake_gpus(monkeypatch):
    calls = []

    def set_device(i):
        if i >= torch.cuda.device_count():
            raise RuntimeError("CUDA error: invalid device ordinal")
        calls.append(("set_device", i))

    def setup(count: int, local_rank: int, visible: str | None = None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        monkeypatch.setattr(dist, "init_process_group",
                            lambda backend, **kw: calls.append(("init", backend)))
        monkeypatch.setattr(dist, "get_rank", lambda: local_rank)
        monkeypatch.setattr(dist, "get_world_size", lambda: 2)
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        return calls
    return setup


def test_more_local_ranks_than_gpus(fake_gpus):
    calls = fake_gpus(count=1, local_rank=1)
    with pytest.raises(ConfigError) as e:
        nncompile.init_distributed()
    msg = str(e.value)
    for part in ("local rank 1", "LOCAL_RANK=1", "cuda:1", "sees 1 GPU",
                 "--nproc_per_node=1", "CUDA_VISIBLE_DEVICES", 'backend="gloo"'):
        assert part in msg, (part, msg)
    assert calls == []                      # neither set_device nor the process group


def test_message_names_visible_devices(fake_gpus):
    fake_gpus(count=2, local_rank=3, visible="4,5")
    with pytest.raises(ConfigError, match=r"sees 2 GPUs \(CUDA_VISIBLE_DEVICES='4,5'\).*"
                                          r"--nproc_per_node=2"):
        nncompile.init_distributed()


def test_nccl_without_any_gpu(fake_gpus, monkeypatch):
    fake_gpus(count=0, local_rank=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"sees 0 GPUs.*backend=\"gloo\""):
        nncompile.init_distributed(backend="nccl")


def test_local_rank_with_its_gpu_starts(fake_gpus):
    calls = fake_gpus(count=2, local_rank=1)
    assert nncompile.init_distributed() == (1, 2)
    assert calls == [("set_device", 1), ("init", "nccl")]
