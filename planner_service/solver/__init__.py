"""The MILP oracle (OR-Tools, imported lazily): exact plans within a candidate space, and the greedy's gap.

`milp.solve_milp(problem, ...)` returns a `Plan` like every solver; the
formulation is written out in `milp.py`'s docstring and built in
`formulation.py`; `backends.py` holds the integer model and the solvers
that run it (CBC in child processes, so its time limit is wall clock);
`gap.py` runs the greedy-versus-MILP study.
"""
