"""The package version (nncompile.__version__), for the core modules that record it."""
__version__ = "0.1.0"
