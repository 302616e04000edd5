"""nncompile.clip_grad_norm_ on 4 gloo ranks: the global norm (2 and inf) and the clipped
gradients equal torch.nn.utils.clip_grad_norm_ on one device, for tp at plan 2 and 4 and dp."""


def test_clip_grad_norm_matches_single_device(run_ranks, tmp_path):
    out = run_ranks("tests/workers/clip.py", 4, "--savedir", str(tmp_path))
    assert out.count("ok clip") == 6
