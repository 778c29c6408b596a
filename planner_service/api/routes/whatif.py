from __future__ import annotations

from fastapi import APIRouter

from planner_service.api.deps import OperatorDep, ServiceDep
from planner_service.service import questions
from planner_service.service.inputs import WhatIfIn
from planner_service.wire.plan import WhatIfOut

router = APIRouter(prefix="/v1/whatif", tags=["what-if"])


@router.post("", response_model=WhatIfOut, response_model_exclude_unset=True)
def what_if(body: WhatIfIn, service: ServiceDep, _: OperatorDep) -> WhatIfOut:
    """Plan hypothetical changes on a copy of the live state; the live state is not touched."""
    return WhatIfOut.model_validate(questions.what_if(service.live_view(), body, service.solve))
