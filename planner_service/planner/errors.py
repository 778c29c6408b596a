"""Planner exceptions, apart from the compiled planner modules (mypyc cannot compile a subclass of RuntimeError)."""


class PlanningError(RuntimeError):
    """The plan would break a hard constraint; the message names it."""
