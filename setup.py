"""Optional mypyc build of the planner's hot modules (the build the Docker image ships).

`pip install -e .` and `pip install .` stay pure Python. With `STATEBUDGET_COMPILE=1` the modules below
are compiled to C extensions; plans are the same, about 1.3x faster. The build needs mypy and a C compiler
(`pip install 'statebudget[compile]'`), the installed wheel neither:

    STATEBUDGET_COMPILE=1 pip wheel --no-build-isolation --no-deps -w dist .

`make compiled` does that and installs the wheel into .venv-compiled.
"""

import os

from setuptools import setup

COMPILED = [
    "planner_service/domain/problem.py",
    "planner_service/domain/state.py",
    "planner_service/planner/costs.py",
    "planner_service/planner/greedy.py",
    "planner_service/planner/joint.py",
    "planner_service/planner/lateness.py",
    "planner_service/planner/objective.py",
    "planner_service/planner/operations.py",
    "planner_service/planner/residency.py",
]

ext_modules = []
if os.environ.get("STATEBUDGET_COMPILE") == "1":
    from mypyc.build import mypycify

    # type errors in the uncompiled modules these import do not stop the build
    # (the config's overrides name packages this build does not compile: that is not an error here)
    ext_modules = mypycify(
        ["--follow-imports=silent", "--no-warn-unused-configs", *COMPILED], opt_level="3", group_name="planner_service"
    )

setup(ext_modules=ext_modules)
