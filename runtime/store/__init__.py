"""pm's parameters: what each rank stores and how user code sees it.

The generated code computes with *pieces* (pieces.py: this rank's slice of each parameter,
or ZeRO-3's flat units, zero.py); the user's module and `pm.parameters()` hold DTensors over
them (module_views.py, zero3_views.py; gradients and hooks in view_grads.py), named as in the
model (model_names.py). Parameters of the original module pm did not take are released
(released.py); pipelines keep only a rank's stages (stage_params.py). Which rank holds and
stores what is holders.py; the DTensors' mesh is dtensors.py. Imports protocol only.
"""
