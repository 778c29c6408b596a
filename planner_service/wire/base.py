"""The configuration every wire model shares."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """A body the API sends: immutable, and tolerant of fields a newer service adds (clients ignore them).

    Fields that the JSON names differently from Python (`from`, `to`) are read by either name and written
    by their JSON name.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", validate_by_name=True, serialize_by_alias=True)


class WireIn(BaseModel):
    """A body a client sends: immutable, and strict (an unknown field is refused with its name, as is a number
    that is not finite)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
