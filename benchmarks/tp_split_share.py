"""How much of each model's layer blocks `tp` splits: the share of weight elements (parameters of
2 or more dims inside numbered blocks, `h.3.attn.c_attn.weight`) that plan.json places as a
Shard, at plan 2, for third-party models built from tiny configs (no download).

    python benchmarks/tp_split_share.py [hf_gpt2,falcon_per_head,falcon_multi_query,swin,resnet]

It reads only plan.json, so it measures older versions of nncompile too. A Megatron plan of a
transformer splits every block weight (1.000); what stays replicated is named by the `tp`
warning (run with NNCOMPILE_QUIET unset to see it).
"""
import json, os, re, sys, tempfile, warnings
os.environ["NNCOMPILE_QUIET"] = "1"
import torch, nncompile, transformers as tf

class LM(torch.nn.Module):
    def __init__(s, m): super().__init__(); s.m = m
    def forward(s, input_ids, labels): return s.m(input_ids=input_ids, labels=labels, use_cache=False).loss
class Img(torch.nn.Module):
    def __init__(s, m): super().__init__(); s.m = m
    def forward(s, x, y): return s.m(pixel_values=x, labels=y).loss

def lm(cfg_cls, model_cls, **kw):
    torch.manual_seed(0)
    m = LM(model_cls(cfg_cls(vocab_size=64, **kw)))
    ids = torch.randint(0, 64, (2, 16))
    return m, {"input_ids": ids, "labels": ids}

def img(m, size=32):
    return Img(m), {"x": torch.randn(2, 3, size, size), "y": torch.tensor([1, 0])}

MODELS = {
 "hf_gpt2": lambda: lm(tf.GPT2Config, tf.GPT2LMHeadModel, n_embd=32, n_layer=2, n_head=4, n_positions=32),
 "falcon_per_head": lambda: lm(tf.FalconConfig, tf.FalconForCausalLM, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=False, new_decoder_architecture=False),
 "falcon_multi_query": lambda: lm(tf.FalconConfig, tf.FalconForCausalLM, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
 "swin": lambda: img(tf.SwinForImageClassification(tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=5, drop_path_rate=0.0))),
 "resnet": lambda: img(tf.ResNetForImageClassification(tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=5))),
}
for name in (sys.argv[1] if len(sys.argv) > 1 else ",".join(MODELS)).split(","):
    m, batch = MODELS[name]()
    shapes = {n: p.shape for n, p in m.named_parameters()}
    with tempfile.TemporaryDirectory() as d:
        out = nncompile.parallelize(m, batch, nncompile.ComputeConfig(2), pas_policy="tp", gen_savedir=d, load_module=False)
        plan = json.loads((out / "plan.json").read_text())
    tot = sp = 0
    for fqn, pl in plan["params"].items():
        shp = shapes.get(fqn)
        if shp is None or len(shp) < 2 or not re.search(r"\.\d+\.", fqn):
            continue
        tot += shp.numel(); sp += shp.numel() if str(pl).startswith("S") else 0
    print(f"{name}: {sp / tot:.3f}")
