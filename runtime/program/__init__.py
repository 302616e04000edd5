"""Running a rank's program: ParallelModule, the generated GenModel's base (module.py) and
loading it (loader.py); the collectives and expert dispatch the generated code calls
(comm.py, experts.py), random state (rng.py), float8 linears (float8.py), gradient reduction
(reducer.py), micro-batches and pipelines (pipeline.py), what ranks check at load
(consistency.py) and copies of pm (copying.py). Imports every other runtime package.
"""
