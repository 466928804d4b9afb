"""The JSON-schema pieces of tk serve's request bodies (pydantic): strict models that coerce nothing
and forbid unnamed fields (`Strict`), whole numbers with their bounds in the document (`Int`), and
rules between an object's fields written as JSON Schema `if`/`then` (`when`, `given`, `rules`),
which the models' validators enforce. The bodies are the schemas and responses_schemas modules'.
No `from __future__ import annotations` (pydantic reads the annotations).
"""

from typing import Annotated, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from tk.toolkit.serving.openai.api import LIMITS


def _integral(value):
    """JSON Schema's integer includes 2.0: take it as 2 (strict models refuse floats, bools and strings)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def below(n: int) -> str:
    """A regex of the decimal numbers 0 .. n - 1, no leading zeros (logit_bias' keys: token ids as JSON keys)."""
    def digits(low: int, high: int) -> str:
        return str(low) if low == high else f"[{low}-{high}]"

    def any_digits(k: int) -> str:
        return "" if k == 0 else "[0-9]" if k == 1 else f"[0-9]{{{k}}}"

    top = str(n - 1)
    if len(top) == 1:
        return f"^{digits(0, n - 1)}$"
    alternatives = ["[0-9]"] + [f"[1-9]{any_digits(k - 1)}" for k in range(2, len(top))]  # the shorter numbers
    for i, d in enumerate(top):  # as long as top: equal to it before digit i, below it there
        if int(d) > (low := 1 if i == 0 else 0):
            alternatives.append(f"{top[:i]}{digits(low, int(d) - 1)}{any_digits(len(top) - i - 1)}")
    return f"^({'|'.join([*alternatives, top])})$"


def Int(**bounds):  # the bounds inside, so that the JSON schema says minimum/maximum (not pydantic's ge/le)
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Text = Annotated[str, Field(min_length=1)]  # an empty prompt has no token to start from
Stop = Union[Annotated[str, Field(max_length=LIMITS["stop_chars"])],
             Annotated[list[Annotated[str, Field(max_length=LIMITS["stop_chars"])]], Field(max_length=LIMITS["stop"])],
             None]


class Strict(BaseModel):  # no coercion either: `"seed": false` or `"max_tokens": "5"` is a 400, as the schema says
    model_config = ConfigDict(extra="forbid", strict=True)


NOT_NULL, ABSENT = {"not": {"type": "null"}}, {"type": "null"}  # (ABSENT: a field left out, or null)


def when(condition: dict, then: dict, otherwise: dict | None = None) -> dict:
    """A rule between an object's fields, in JSON Schema (the validators that enforce it are pydantic's)."""
    return {"if": condition, "then": then, **({"else": otherwise} if otherwise is not None else {})}


def given(field: str, schema: dict) -> dict:
    """An object whose `field` is present and matches `schema`."""
    return {"properties": {field: schema}, "required": [field]}


def rules(*clauses: dict) -> ConfigDict:
    """A model's cross-field rules in its JSON schema."""
    return ConfigDict(json_schema_extra={"allOf": list(clauses)})
