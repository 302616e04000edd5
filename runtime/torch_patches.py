"""Install an nncompile replacement over a torch attribute, once.

Before: ``owner.attr`` is torch's function.
After:  ``wrap_once(owner, "attr", mine)`` returns torch's function and sets ``owner.attr``
(and the same name on each module in ``also``) to ``mine`` dressed as torch's; a second call
finds the marker and returns None, leaving everything as it is.
"""
import functools


def wrap_once(owner, attr, replacement, also=()):
    """Replace ``owner.attr`` (and ``attr`` on each of ``also``) by ``replacement``; return the
    replaced function, or None when it is already ours."""
    current = getattr(owner, attr)
    if getattr(current, "_nncompile", False):
        return None
    wrapper = functools.wraps(current)(replacement)
    wrapper._nncompile = True
    for target in (owner, *also):
        setattr(target, attr, wrapper)
    return current
