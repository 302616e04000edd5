"""nncompile's runtime: what a generated rank program runs on. Five packages, each importing
only the ones listed before it (tests/test_layers.py checks it), none importing the compiler:

    protocol     how ranks agree: process groups, start and end of the job, lockstep forwards,
                 shared outcomes, the hang report
    store        pm's parameters: the pieces it computes with, ZeRO-3's flat units, the DTensors
                 the user's module and pm.parameters() hold, their names, gradients and hooks
    optim        optimizers over the store: build_optimizer (ZeRO-1/2/3, offload), adopting a
                 plain torch optimizer, clipping, GradScaler
    checkpoints  a rank's state and every format it is saved in: sharded, deduped, merged, DCP,
                 async, the model's own state dict, Hugging Face safetensors
    program      running a rank's program: ParallelModule (the generated GenModel's base), its
                 collectives, random state, gradient reduction, pipelines, float8, copies
"""
