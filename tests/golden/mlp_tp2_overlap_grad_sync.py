# nncompile IR: plan_ngpus=2 stages=folded,planned,comm_inserted,localized
def forward(
    x,  # f32[4, 16] of [4, 16] R
    y,  # i64[4] of [4] R
    *,
    fc1_weight,  # param 'fc1.weight' f32[32, 16] of [64, 16] S(0)
    fc1_bias,  # param 'fc1.bias' f32[32] of [64] S(0)
    fc2_weight,  # param 'fc2.weight' f32[64, 32] of [64, 64] S(1)
    fc2_bias,  # param 'fc2.bias' f32[64] of [64] R
    head_weight,  # param 'head.weight' f32[8, 64] of [8, 64] R
    head_bias,  # param 'head.bias' f32[8] of [8] R
):
    # tests/models.py:24  h = F.relu(self.fc1(x))
    fc1_linear = aten.linear.default(x, fc1_weight, fc1_bias)  # f32[4, 32] of [4, 64] S(1)  [split n]
    relu = aten.relu.default(fc1_linear)  # f32[4, 32] of [4, 64] S(1)  [split dim 1]
    # tests/models.py:25  h = torch.tanh(self.fc2(h))
    fc2_bias_to_partial = comm.to_partial(fc2_bias, group=PLAN_GROUP)  # f32[64] of [64] P  [to_partial]
    fc2_linear = aten.linear.default(relu, fc2_weight, fc2_bias_to_partial)  # f32[4, 64] of [4, 64] P  [split k]
    fc2_linear_all_reduce = comm.all_reduce(fc2_linear, group=PLAN_GROUP)  # f32[4, 64] of [4, 64] R  [all_reduce]
    tanh = aten.tanh.default(fc2_linear_all_reduce)  # f32[4, 64] of [4, 64] R  [replicate]
    # tests/models.py:26  return F.cross_entropy(self.head(h), y)
    head_linear = aten.linear.default(tanh, head_weight, head_bias)  # f32[4, 8] of [4, 8] R  [replicate]
    cross_entropy_loss = aten.cross_entropy_loss.default(head_linear, y)  # f32[] of [] R  [replicate]
    return (cross_entropy_loss,)
