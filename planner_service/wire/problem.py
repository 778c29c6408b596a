"""The one error shape of the HTTP API: `application/problem+json` (RFC 9457).

Every error answer of the service, whatever raised it, is a `Problem`. `field`
names the first offending field of the request and `errors` lists each one,
as dotted paths into the request the caller sent (`events.0.model`,
`max_operations`, `(body)` for the whole body): no transport prefix such as
`body.` or `query.`, no name of a union member the caller never wrote.
Errors that are not about a field (404, 409, 503...) carry `field: null` and
an empty `errors`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

PROBLEM_JSON = "application/problem+json"
WHOLE_BODY = "(body)"  # the `field` of a problem with the request body as a whole (not JSON, not an object)


class FieldError(BaseModel):
    """One thing wrong with one field of the request."""

    model_config = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)

    field: str = Field(description="Dotted path into the request: `events.0.model`, `max_operations`, `(body)`.")
    message: str = Field(description="What is wrong with it, in words.")


class Problem(BaseModel):
    """An error answer (RFC 9457 problem details, with `field` and `errors` as extension members)."""

    model_config = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)

    type: str = Field("about:blank", description="A URI that identifies the kind of problem; `about:blank` here.")
    title: str = Field(description="A short summary of the kind of problem (`Invalid input`, `Not found`...).")
    status: int = Field(ge=400, le=599, description="The HTTP status code of the answer.")
    detail: str = Field(description="What went wrong this time and, where it helps, what to do about it.")
    field: str | None = Field(None, description="The first offending field of the request, if the problem is one.")
    errors: list[FieldError] = Field(
        default_factory=list, description="Every offending field, in the order found; empty if no field is at fault."
    )
