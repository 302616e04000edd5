"""How ranks agree, at the bottom of the runtime: the job's process groups (groups.py), starting
it with a timeout (distributed.py), forwards run together or served (lockstep.py), every rank
learning every rank's outcome of a step that may fail (outcomes.py), and where each rank is
when they stop agreeing (hang_report.py). Imports no other runtime package.
"""
