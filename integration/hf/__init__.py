"""Hugging Face transformers: `NnCompileTrainer`, a Trainer that trains an nncompile
ParallelModule (tensor / data parallel plans, ZeRO) instead of wrapping the model in DDP."""
from .trainer import NnCompileTrainer

__all__ = ["NnCompileTrainer"]
