"""Tools around the compiler: inspection (`nncompile show`), plots, memory profiles, the
divergence check (`nncompile.verify`), the op-rule checker and threaded simulated ranks.

They read what the core compiler (nncompile.ir, nncompile.rules, nncompile.passes, codegen)
writes and may run the runtime (nncompile.runtime); neither of those imports them.
"""
