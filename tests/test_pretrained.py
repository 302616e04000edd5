"""Hugging Face checkpoints in and out: nncompile.save_pretrained writes what
model.save_pretrained writes, from any plan; nncompile.load_pretrained reads only each rank's
slices into any plan, a meta-built model included; `python -m nncompile export` turns any
checkpoint format into the same files. Bad checkpoints are errors naming the key or file, and
a save that fails leaves nothing half written."""
import json
import os
import re

import pytest
import torch

import models
import nncompile
from nncompile import CheckpointError, ComputeConfig
from nncompile.safetensors_file import SafetensorsWriter
from nncompile.tools.simulate import run_ranks

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

# transformers 4.57 traces neither Mixtral (its MoE loops over the experts a batch hit) nor a
# model built on meta (its rotary embedding enters torch.autocast on the meta device):
# docs/versions.md
HF5 = int(transformers.__version__.split(".")[0]) >= 5
needs_hf5 = pytest.mark.skipif(not HF5, reason="Mixtral and meta-built models trace with "
                                               "transformers 5 (docs/versions.md)")


def test_save_pretrained_from_every_plan(run_ranks, tmp_path):
    """Llama (tied embeddings) and Mixtral after 3 AdamW steps under tp 2, ZeRO-3 dp 2
    (Mixtral with offload_params) and pp 2: from_pretrained holds exactly the gathered
    weights; files, index and config equal model.save_pretrained's; the files load back into
    the same plan (worker)."""
    import workers.pretrained as w
    cases = [c for c in w.CASES if HF5 or not c.startswith("mixtral")]
    out = run_ranks("tests/workers/pretrained.py", 2, "save", "--workdir", str(tmp_path),
                    "--cases", *cases)
    for name in cases:
        assert re.search(rf"{name}: \d+ files like model.save_pretrained, \d+ weights exact",
                         out), out[-3000:]
    # the small shard size split them: both ranks wrote files
    assert len(list((tmp_path / "llama-zero3").glob("model-*-of-*.safetensors"))) > 2


@needs_hf5
def test_load_into_meta_model_tp2_zero3_dp2_with_a_shard_of_memory(run_ranks, tmp_path):
    """A ~125 MB Llama saved by model.save_pretrained (in shards) loads into the model built
    on meta and compiled for tp 2 x ZeRO-3 dp 2: the loss equals the eager model's, and on
    every rank the shard plus the peak the load added stays below 0.6 x the model's bytes;
    saving it again stays below the whole model."""
    import workers.pretrained as w
    model = w.build("llama", "big", seed=3)
    b = w.batch(0, model.config.vocab_size, rows=2)
    with torch.no_grad():
        loss = model(**b, use_cache=False).loss
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt, max_shard_size="40MB")
    torch.save(loss, ckpt / "loss.pt")
    del model
    out = run_ranks("tests/workers/pretrained.py", 4, "load", "--workdir", str(tmp_path),
                    "--ckpt", str(ckpt))
    ratios = [float(r) for r in re.findall(r", ratio (\d+\.\d{3})", out)]
    assert len(ratios) == 4, out[-3000:]
    assert max(ratios) < 0.6, out[-3000:]
    assert out.count("== eager") == 4
    # and saving it back: no rank holds the whole model (its shard + the peak save added)
    saves = [float(r) for r in re.findall(r"save ratio (\d+\.\d{3})", out)]
    assert len(saves) == 4 and max(saves) < 1.0, out[-3000:]


def _llama_pm(tmp_path, seed=0, meta=False, **kw):
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = models.hf_llama()
    x = torch.randint(1, 64, (2, 8))
    pm = nncompile.parallelize(model, {"input_ids": x, "labels": x}, ComputeConfig(1, 1),
                               pas_policy="data", gen_savedir=str(tmp_path / "gen"), **kw)
    return pm, model


def _weights(pm) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pm.gather_params().items()}


@pytest.fixture
def saved(tmp_path):
    """A small Llama's directory as model.save_pretrained writes it, and a pm to load into."""
    pm, model = _llama_pm(tmp_path, seed=1, instance_name="target")
    torch.manual_seed(2)
    source = models.hf_llama().model
    d = tmp_path / "ckpt"
    source.save_pretrained(d)
    return d, pm, source


def test_load_pretrained_single_process(saved):
    d, pm, source = saved
    nncompile.load_pretrained(pm, d)
    got = _weights(pm)
    assert len(got) == len(list(source.parameters()))        # each once, tied or not
    for k, v in got.items():
        assert torch.equal(source.state_dict()[k.removeprefix("model.")], v), k


@needs_hf5
def test_load_pretrained_into_meta_built_model(saved, tmp_path):
    d, pm, _ = saved
    nncompile.load_pretrained(pm, d)
    got = _weights(pm)
    meta_pm, _ = _llama_pm(tmp_path, meta=True, instance_name="meta")
    nncompile.load_pretrained(meta_pm, d / "model.safetensors")       # one file also loads
    assert all(torch.equal(v, got[k]) for k, v in _weights(meta_pm).items())


def _expect(pm, path, *words):
    before = _weights(pm)
    with pytest.raises(CheckpointError) as e:
        nncompile.load_pretrained(pm, path)
    msg = str(e.value)
    for word in words:
        assert word in msg, msg
    assert all(torch.equal(v, before[k]) for k, v in _weights(pm).items()), \
        "a refused checkpoint changed weights"
    return msg


def test_bad_checkpoints_are_clear_errors_that_change_nothing(saved, tmp_path):
    d, pm, source = saved
    sd = load_file(d / "model.safetensors")

    def variant(name, tensors, config=True):
        out = tmp_path / name
        out.mkdir()
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        if config:
            (out / "config.json").write_text((d / "config.json").read_text())
        return out

    key = "model.layers.1.mlp.up_proj.weight"
    _expect(pm, variant("missing", {k: v for k, v in sd.items() if k != key}),
            repr(key), "has no")
    _expect(pm, variant("extra", {**sd, "model.layers.9.mlp.w.weight": torch.zeros(2)}),
            "'model.layers.9.mlp.w.weight'", "does not have")
    _expect(pm, variant("shape", {**sd, key: torch.zeros(3, 3)}), repr(key), "[3, 3]")
    _expect(pm, variant("dtype", {**sd, key: sd[key].bfloat16()}), repr(key), "bfloat16")
    # another architecture: config.json says so before any name is compared
    mixtral = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, num_local_experts=4)
    other = tmp_path / "mixtral"
    transformers.AutoModelForCausalLM.from_config(mixtral).save_pretrained(other)
    _expect(pm, other, "MixtralForCausalLM", "'mixtral'", "LlamaForCausalLM")
    # a truncated file, a shard the index lists but the directory lacks, no weights at all
    cut = tmp_path / "cut"
    cut.mkdir()
    data = (d / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) - 100])
    _expect(pm, cut, "truncated", "model.safetensors")
    (cut / "model.safetensors").write_bytes(data[:4])
    _expect(pm, cut, "not a readable safetensors file")
    shards = tmp_path / "shards"
    source.save_pretrained(shards, max_shard_size=20000)
    gone = sorted(shards.glob("model-*.safetensors"))[-1]
    gone.unlink()
    _expect(pm, shards, gone.name, "not in")
    _expect(pm, tmp_path / "gen", "neither model.safetensors nor")


def test_a_failed_save_leaves_the_last_one_whole(saved, tmp_path, monkeypatch):
    d, pm, _ = saved
    out = tmp_path / "out"
    nncompile.save_pretrained(pm, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []

    def disk_full(self, name, tensor):
        calls.append(name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, name, tensor)

    real = SafetensorsWriter.write
    monkeypatch.setattr(SafetensorsWriter, "write", disk_full)
    nncompile.load_pretrained(pm, d)                      # other weights to save
    with pytest.raises(CheckpointError, match="No space left on device"):
        nncompile.save_pretrained(pm, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before   # no temporary files


def test_writer_streams_any_order_and_dtype(tmp_path):
    tensors = {"b": torch.randn(3, 5).bfloat16(), "a": torch.arange(7),
               "c": torch.tensor([True, False, True]), "d": torch.randn(2, 3).t(),
               "e": torch.tensor(2.5, dtype=torch.float16)}
    w = SafetensorsWriter(tmp_path / "x.safetensors",
                          {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()},
                          {"format": "pt"})
    for k in ("d", "a", "e", "c", "b"):
        w.write(k, tensors[k])
    assert not (tmp_path / "x.safetensors").exists()      # only when committed
    w.commit()
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    w = SafetensorsWriter(tmp_path / "y.safetensors", {"a": ((2,), torch.float32)})
    with pytest.raises(CheckpointError, match="never"):
        w.commit()
    assert os.listdir(tmp_path) == ["x.safetensors"]


def _gpt(seed=0):
    from examples.gpt import GPT
    torch.manual_seed(seed)
    return GPT(vocab_size=16, block_size=32, n_layer=2, n_head=4, n_embd=64)


def test_plain_module_tp2_round_trip_and_export(tmp_path):
    """nanoGPT (not a Hugging Face model; c_attn held as q/k/v parts under tp, wte/lm_head
    tied) under tp 2 on threaded ranks: save_pretrained writes the state_dict's names (the
    tie once), load_pretrained into another initialization gives the same weights back, and
    `python -m nncompile export` of its sharded and dcp checkpoints writes the same files."""
    from nncompile.__main__ import main
    idx = torch.randint(0, 16, (2, 32))
    model = _gpt()
    cfg = ComputeConfig(2, 2)

    def rank_fn(rank):
        pm = nncompile.parallelize(_gpt(), {"idx": idx, "targets": idx}, cfg, pas_policy="tp",
                                   gen_savedir=str(tmp_path / "gen"))
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        pm(idx, idx).backward()
        opt.step()
        want = _weights(pm)
        nncompile.save_pretrained(pm, tmp_path / "hf")
        nncompile.save_checkpoint(tmp_path / "ckpt", pm)
        nncompile.save_checkpoint(tmp_path / "dcp", pm, format="dcp")
        fresh = nncompile.parallelize(_gpt(seed=5), {"idx": idx, "targets": idx}, cfg,
                                      pas_policy="tp", gen_savedir=str(tmp_path / "gen"))
        nncompile.load_pretrained(fresh, tmp_path / "hf")
        return want, _weights(fresh)

    for want, got in run_ranks(2, rank_fn):
        assert want.keys() == got.keys()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    keys = [k for k in model.state_dict() if k != "lm_head.weight"]
    assert sorted(saved) == sorted(keys)            # lm_head.weight is wte.weight: once
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"]     # no config: none written
    for fmt in ("ckpt", "dcp"):                         # a sharded and a dcp checkpoint
        assert main(["export", str(tmp_path / fmt), "-o", str(tmp_path / f"x_{fmt}")]) == 0
        exported = load_file(tmp_path / f"x_{fmt}" / "model.safetensors")
        assert exported.keys() == saved.keys()
        assert all(torch.equal(exported[k], v) for k, v in saved.items())


@needs_hf5
def test_export_of_a_mixtral_checkpoint_matches_save_pretrained(tmp_path, capsys):
    """A merged file of a Hugging Face model wrapped in another module (keys under
    "model.") exports, with the config found beside it, to model.save_pretrained's files
    (Mixtral's fused experts back to one tensor per expert, shards and index included)."""
    from nncompile.__main__ import main
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"model": {f"model.{k}": v for k, v in models.HFCausalLM(hf).model
                          .state_dict().items()}}, src / "merged.pt")
    hf.config.save_pretrained(src)
    assert main(["export", str(src / "merged.pt"), "-o", str(tmp_path / "out"),
                 "--max-shard-size", "20000"]) == 0
    assert "exported" in capsys.readouterr().out
    hf.save_pretrained(tmp_path / "ref", max_shard_size=20000)
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(tmp_path / "ref"))
    for f in os.listdir(tmp_path / "ref"):
        a, b = tmp_path / "out" / f, tmp_path / "ref" / f
        if f.endswith(".safetensors"):
            x, y = load_file(a), load_file(b)
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        elif f == INDEX:
            assert json.loads(a.read_text()) == json.loads(b.read_text())
    assert main(["export", str(src / "merged.pt"), "-o", str(tmp_path / "bad"),
                 "--config", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


INDEX = "model.safetensors.index.json"


@needs_hf5
def test_lightning_loads_and_saves_pretrained(run_ranks, tmp_path):
    """NnCompileStrategy(pretrained=dir) on 2 ranks (tp 2), the LightningModule's Llama built
    on meta: validation logs the eager model's loss; strategy.save_pretrained after two steps
    writes what from_pretrained reads back as the trained weights (worker)."""
    import workers.pretrained as w
    model = w.build("llama", seed=4)
    with torch.no_grad():
        loss = model(**w.batch(9), use_cache=False).loss
    model.save_pretrained(tmp_path / "ckpt")
    torch.save(loss, tmp_path / "ckpt" / "val_loss.pt")
    out = run_ranks("tests/workers/lightning_pretrained.py", 2, "--ckpt",
                    str(tmp_path / "ckpt"), "--savedir", str(tmp_path))
    assert "ok lightning pretrained" in out, out[-3000:]


def test_meta_buffers_outside_hugging_face_are_a_clear_error(tmp_path):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x):
            return (self.lin(x) * self.scale).sum()

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(nncompile.ConfigError, match="buffer 'scale' is on meta"):
        nncompile.parallelize(model, {"x": torch.randn(2, 4)}, ComputeConfig(1, 1),
                              pas_policy="data", gen_savedir=str(tmp_path))


def test_a_from_pretrained_model_parallelizes(saved, tmp_path):
    """from_pretrained maps the safetensors file into the parameters' storage, which cannot
    be resized; tp 2 still releases the original's parameters (threaded ranks) and computes
    the eager loss."""
    d, _, source = saved
    x = torch.randint(1, 64, (2, 8))
    with torch.no_grad():
        want = float(source(input_ids=x, labels=x, use_cache=False).loss)

    # loaded here: from_pretrained is not thread-safe (it patches torch's init functions)
    loaded = [models.HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(d))
              for _ in range(2)]

    def rank_fn(rank):
        model = loaded[rank]
        originals = list(model.parameters())     # (the module then holds DTensor views)
        pm = nncompile.parallelize(model, {"input_ids": x, "labels": x}, ComputeConfig(2, 2),
                                   pas_policy="tp", gen_savedir=str(tmp_path / "gen"))
        released = sum(p.untyped_storage().nbytes() == 0 for p in originals)
        with torch.no_grad():
            return float(pm(x, x)), released

    for loss, released in run_ranks(2, rank_fn):
        assert abs(loss - want) <= 1e-5 * abs(want) and released > 0


def test_saving_again_replaces_the_shards(saved, tmp_path):
    """A save into a directory holding an earlier sharded save leaves only its own files
    (stale shards and index removed, other files kept), as model.save_pretrained does."""
    _, pm, _ = saved
    out = tmp_path / "again"
    nncompile.save_pretrained(pm, out, max_shard_size=20000)
    assert (out / INDEX).exists() and len(list(out.glob("model-*.safetensors"))) > 2
    (out / "tokenizer.json").write_text("{}")
    nncompile.save_pretrained(pm, out)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                       "model.safetensors", "tokenizer.json"]


def test_gpt2_t5_bart_files_equal_model_save_pretrained(tmp_path):
    """GPT-2 (Conv1D weights, tied head), T5 and BART (embeddings shared by encoder, decoder
    and head): the same files, tensors and config as model.save_pretrained; and those files
    load back into the scrambled parallel module."""
    for name in ("hf_gpt2", "hf_t5", "hf_bart"):
        model = models.build(name)
        ref = tmp_path / f"{name}-hf"
        model.model.save_pretrained(ref)
        pm = nncompile.parallelize(model, models.batch(name, 0), ComputeConfig(1, 1),
                                   pas_policy="data", gen_savedir=str(tmp_path / "gen"),
                                   instance_name=name)
        want = _weights(pm)
        out = tmp_path / name
        nncompile.save_pretrained(pm, out)
        assert sorted(os.listdir(out)) == sorted(os.listdir(ref)), name
        got, exp = load_file(out / "model.safetensors"), load_file(ref / "model.safetensors")
        assert got.keys() == exp.keys() and all(torch.equal(got[k], exp[k]) for k in got), name
        assert json.loads((out / "config.json").read_text()) == \
            json.loads((ref / "config.json").read_text()), name
        with torch.no_grad():
            for p in pm.stored_parameters():
                p.normal_()
        nncompile.load_pretrained(pm, ref)
        assert all(torch.equal(v, want[k]) for k, v in _weights(pm).items()), name


def test_bfloat16_is_kept(tmp_path):
    model = models.hf_llama().to(torch.bfloat16)
    x = torch.randint(1, 64, (2, 8))
    model.model.save_pretrained(tmp_path / "ref")
    pm = nncompile.parallelize(model, {"input_ids": x, "labels": x}, ComputeConfig(1, 1),
                               pas_policy="data", gen_savedir=str(tmp_path / "gen"))
    nncompile.save_pretrained(pm, tmp_path / "out")
    got, exp = (load_file(tmp_path / d / "model.safetensors") for d in ("out", "ref"))
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], exp[k]) for k in exp)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"     # 4.57: torch_dtype


class _TwoModels(torch.nn.Module):
    """DPO-style: a frozen reference registered first, then the trained policy."""

    def __init__(self):
        super().__init__()
        self.reference = models.hf_llama().model
        self.policy = models.hf_llama().model
        self.reference.requires_grad_(False)

    def forward(self, input_ids, labels):
        with torch.no_grad():
            ref = self.reference(input_ids=input_ids, labels=labels).loss
        return self.policy(input_ids=input_ids, labels=labels).loss - ref


def test_several_models_inside_need_a_prefix(tmp_path):
    """save_pretrained without prefix= on a wrapper of two Hugging Face models is an error
    naming both and which one trains; with prefix= it writes the one asked for."""
    torch.manual_seed(0)
    model = _TwoModels()
    x = torch.randint(1, 64, (2, 8))
    pm = nncompile.parallelize(model, {"input_ids": x, "labels": x}, ComputeConfig(1, 1),
                               pas_policy="data", gen_savedir=str(tmp_path / "gen"))
    with pytest.raises(CheckpointError, match=r"holds 2 Hugging Face models: 'reference' "
                       r"\(LlamaForCausalLM, frozen\), 'policy' \(LlamaForCausalLM, trained\); "
                       r"pass prefix= .* e\.g\. prefix='policy\.'"):
        nncompile.save_pretrained(pm, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="2 Hugging Face models"):
        nncompile.load_pretrained(pm, tmp_path / "out")
    nncompile.save_pretrained(pm, tmp_path / "out", prefix="policy.")
    policy = model.policy.state_dict()
    saved = load_file(tmp_path / "out" / "model.safetensors")
    weights = pm.gather_params()
    assert saved and all(torch.equal(t, weights[f"policy.{k}"]) for k, t in saved.items())
    assert not all(torch.equal(t, weights[f"reference.{k}"]) for k, t in saved.items())
    assert set(saved) <= set(policy)
