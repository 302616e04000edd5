"""Integrations of nncompile with training frameworks."""
