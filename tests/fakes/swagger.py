"""Checks JSON values and HTTP requests against an OpenAPI 2 (swagger) document.

Used by the fake KFP API server: every request's path, query, form fields and body, and
every response it sends, must match the upstream v2beta1 swagger. Objects with declared
`properties` reject unknown fields (as the API server's protobuf JSON decoding does);
scalars are type-checked; int64 values may be strings (as protobuf JSON writes them).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class SchemaMismatch(Exception):
    """A value does not match the swagger schema; the message names the field."""


@dataclass(frozen=True)
class Operation:
    method: str
    template: str
    pattern: re.Pattern[str]
    path_names: dict[str, str]
    """regex group name -> swagger parameter name (which may contain dots)."""
    spec: dict[str, Any]

    def parameters(self, location: str) -> dict[str, dict[str, Any]]:
        return {p["name"]: p for p in self.spec.get("parameters", []) if p["in"] == location}


class Swagger:
    def __init__(self, path: Path) -> None:
        self.document = json.loads(path.read_text())
        self.definitions: dict[str, Any] = self.document["definitions"]
        self.operations: list[Operation] = []
        for template, methods in self.document["paths"].items():
            for method, spec in methods.items():
                self.operations.append(self._operation(method.upper(), template, spec))
        # Literal paths (e.g. /pipelines/upload) must win over templated ones (/pipelines/{id}).
        self.operations.sort(key=lambda op: (op.template.count("{"), -len(op.template)))

    @staticmethod
    def _operation(method: str, template: str, spec: dict[str, Any]) -> Operation:
        names: dict[str, str] = {}
        regex = ""
        for piece in re.split(r"(\{[^}]+\})", template):
            if piece.startswith("{"):
                group = f"p{len(names)}"
                names[group] = piece[1:-1]
                regex += f"(?P<{group}>[^/:]+)"
            else:
                regex += re.escape(piece)
        return Operation(method, template, re.compile(f"^{regex}$"), names, spec)

    def match(self, method: str, path: str) -> tuple[Operation, dict[str, str]] | None:
        for operation in self.operations:
            found = operation.pattern.match(path)
            if found and operation.method == method:
                return operation, {operation.path_names[g]: v for g, v in found.groupdict().items()}
        return None

    def path_exists(self, path: str) -> bool:
        return any(op.pattern.match(path) for op in self.operations)

    # --- values -------------------------------------------------------------------------

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.definitions[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def check(self, value: Any, schema: dict[str, Any], where: str) -> None:
        schema = self.resolve(schema)
        if value is None:
            return  # protobuf JSON reads null as "not set"
        if "enum" in schema:
            if value not in schema["enum"]:
                raise SchemaMismatch(f"{where}: {value!r} is not one of {schema['enum']}")
            return
        kind = schema.get("type")
        if kind == "object" or "properties" in schema:
            if not isinstance(value, dict):
                raise SchemaMismatch(f"{where}: expected an object, got {type(value).__name__}")
            properties = schema.get("properties")
            if properties is not None:
                for key, item in value.items():
                    if key not in properties:
                        raise SchemaMismatch(f"{where}: unknown field {key!r}")
                    self.check(item, properties[key], f"{where}.{key}")
            elif schema.get("additionalProperties"):
                for key, item in value.items():
                    self.check(item, schema["additionalProperties"], f"{where}.{key}")
        elif kind == "array":
            if not isinstance(value, list):
                raise SchemaMismatch(f"{where}: expected a list, got {type(value).__name__}")
            for index, item in enumerate(value):
                self.check(item, schema.get("items", {}), f"{where}[{index}]")
        elif kind == "string":
            self._check_string(value, schema.get("format"), where)
        elif kind == "integer":
            if isinstance(value, bool) or not isinstance(value, int):
                raise SchemaMismatch(f"{where}: expected an integer, got {value!r}")
        elif kind == "number":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SchemaMismatch(f"{where}: expected a number, got {value!r}")
        elif kind == "boolean" and not isinstance(value, bool):
            raise SchemaMismatch(f"{where}: expected true or false, got {value!r}")

    @staticmethod
    def _check_string(value: Any, fmt: str | None, where: str) -> None:
        if fmt in ("int64", "uint64"):
            if isinstance(value, bool) or not (
                isinstance(value, int) or (isinstance(value, str) and re.fullmatch(r"-?\d+", value))
            ):
                raise SchemaMismatch(f"{where}: expected an int64 (number or digit string), got {value!r}")
            return
        if not isinstance(value, str):
            raise SchemaMismatch(f"{where}: expected a string, got {value!r}")
        if fmt == "date-time":
            try:
                dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                raise SchemaMismatch(f"{where}: {value!r} is not an RFC 3339 time") from None

    def check_query(self, operation: Operation, query: dict[str, list[str]]) -> None:
        declared = operation.parameters("query")
        for name, values in query.items():
            if name not in declared:
                raise SchemaMismatch(f"query parameter {name!r} is not accepted by {operation.template}")
            if len(values) != 1:
                raise SchemaMismatch(f"query parameter {name!r} given {len(values)} times")
            kind = declared[name].get("type")
            if kind == "integer" and not re.fullmatch(r"-?\d+", values[0]):
                raise SchemaMismatch(f"query parameter {name}={values[0]!r} is not an integer")
            if kind == "boolean" and values[0] not in ("true", "false"):
                raise SchemaMismatch(f"query parameter {name}={values[0]!r} is not true or false")
        for name, parameter in declared.items():
            if parameter.get("required") and name not in query:
                raise SchemaMismatch(f"query parameter {name!r} is required by {operation.template}")

    def response_schema(self, operation: Operation) -> dict[str, Any]:
        return operation.spec["responses"]["200"].get("schema", {})
