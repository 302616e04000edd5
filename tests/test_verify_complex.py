"""nncompile.verify on a model with complex intermediate values (torchtitan's rotary:
view_as_complex, a complex product, view_as_real): the per-op comparison measures complex
values by the modulus of their difference, within the float tolerance, so a right plan is OK."""
import torch

import nncompile
from test_tp_rules import BATCH, D, MODELS, SEQ


def test_verify_accepts_complex_rotary_within_tolerance(tmp_path):
    model = MODELS["complex_rotary"]()
    x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(1))
    report = nncompile.verify(model, (x,), nncompile.ComputeConfig(2, 2), "tp",
                              gen_savedir=str(tmp_path))
    assert report.divergence is None, str(report)
    assert report.ok, str(report)
