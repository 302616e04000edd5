"""A rank's state and the formats it is saved in: its optimizer state by name (state.py), the
directory save_checkpoint writes (checkpoint.py, async_checkpoint.py, resume_state.py), DCP
(dcp.py), deduped (dedup.py) and merged (merge.py) state dicts, the original module's full
state (full_state.py), pm.state_dict() in the model's form (model_state.py) and Hugging Face
safetensors (pretrained.py). Imports protocol, store and optim.
"""
