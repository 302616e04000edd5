"""Optimizers over the store: build_optimizer with ZeRO-1/2/3 and offload (optimizer.py), a
plain torch optimizer adopting pm's tensors (adoption.py) and the state handed to it
(carry_state.py), which optimizers may step pieces (elementwise.py), clipping by the global
norm (clip.py) and GradScaler's one decision for the job (grad_scaler.py).
Imports protocol and store.
"""
