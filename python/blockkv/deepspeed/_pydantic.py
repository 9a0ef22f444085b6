# SPDX-License-Identifier: Apache-2.0
"""The one place blockkv.deepspeed touches pydantic's API, for pydantic 1 and 2 alike.

DeepSpeed's configs are pydantic models (``DeepSpeedConfigModel``: extra keys forbidden,
assignment validated, enum values stored, defaults validated, "auto" values dropped) and raise
pydantic's ``ValidationError``. DeepSpeed itself is on pydantic 2; Debian 12 packages pydantic
1.10. ``PYDANTIC_V2`` picks the spelling once; everything else in the package is written against
:class:`ConfigModel`, :func:`model_check` and :func:`field_before`, which mean the same in both.
"""

import pydantic

PYDANTIC_V2 = int(pydantic.VERSION.split(".")[0]) >= 2

ValidationError = pydantic.ValidationError


def _drop_auto(data):
    # DeepSpeedConfigModel drops every field whose value is the string "auto".
    return {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}


if PYDANTIC_V2:

    class ConfigModel(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True,
                                           use_enum_values=True, validate_default=True,
                                           populate_by_name=True, arbitrary_types_allowed=True,
                                           protected_namespaces=())

        def __init__(self, **data):
            super().__init__(**_drop_auto(data))

    def model_check(check):
        """A whole-model check: ``check(values)`` reads the fields from a mapping, raises
        ValueError (which pydantic reports as ValidationError)."""

        def validate(self):
            check(dict(self.__dict__))
            return self

        return pydantic.model_validator(mode="after")(validate)

    def field_before(name, convert):
        """``convert(value)`` runs before the field's own validation (pydantic's "pre")."""
        return pydantic.field_validator(name, mode="before")(classmethod(
            lambda cls, value: convert(value)))

else:

    class ConfigModel(pydantic.BaseModel):

        class Config:
            extra = "forbid"
            validate_assignment = True
            use_enum_values = True
            validate_all = True
            allow_population_by_field_name = True
            arbitrary_types_allowed = True

        def __init__(self, **data):
            super().__init__(**_drop_auto(data))

    def model_check(check):
        """A whole-model check: ``check(values)`` reads the fields from a mapping, raises
        ValueError (which pydantic reports as ValidationError)."""

        def validate(cls, values):
            check(values)
            return values

        return pydantic.root_validator(skip_on_failure=True, allow_reuse=True)(validate)

    def field_before(name, convert):
        """``convert(value)`` runs before the field's own validation (pydantic's "pre")."""

        def validate(cls, value):
            return convert(value)

        return pydantic.validator(name, pre=True, always=True, allow_reuse=True)(validate)
