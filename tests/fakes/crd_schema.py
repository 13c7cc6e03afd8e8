"""Strict validation of Kubernetes objects against a CRD's openAPIV3Schema.

A CRD schema is a JSON-schema dialect: the `x-kubernetes-*` keys are dropped (an
int-or-string field becomes `anyOf: [integer, string]`), and every object that lists its
`properties` without saying otherwise gets `additionalProperties: false`, which is what
`kubectl apply --validate=strict` does with unknown fields. `metadata` is checked against
the ObjectMeta fields a client may send. CEL rules and admission webhooks are not covered.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

_OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "generateName": {"type": "string"},
        "labels": {
            "type": "object",
            "additionalProperties": {
                "type": "string",
                "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
                "maxLength": 63,
            },
        },
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "finalizers": {"type": "array", "items": {"type": "string"}},
        "ownerReferences": {"type": "array"},
    },
}


def strict_schema(node: Any) -> Any:
    """The CRD schema as plain JSON schema with unknown fields rejected."""
    if isinstance(node, list):
        return [strict_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict_schema(value) for key, value in node.items() if not key.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class CustomResource:
    group: str
    version: str
    kind: str
    plural: str
    validator: jsonschema.Draft7Validator

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def errors(self, body: dict[str, Any]) -> list[str]:
        """Every schema violation in `body`, as 'path: message' lines (empty when valid)."""
        found = []
        for error in sorted(self.validator.iter_errors(body), key=lambda e: list(e.absolute_path)):
            path = ".".join(str(part) for part in error.absolute_path) or "<root>"
            found.append(f"{path}: {error.message}")
        if body.get("apiVersion") != self.api_version or body.get("kind") != self.kind:
            found.append(f"apiVersion/kind must be {self.api_version}/{self.kind}")
        return found


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=4)
def load_custom_resources(crd_dir: Path) -> dict[str, CustomResource]:
    """Every served version of every CRD in `crd_dir`, keyed by 'apiVersion/Kind' (cached)."""
    resources = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        for doc in yaml.load_all(path.read_text(), Loader=_LOADER):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if not version.get("served", True):
                    continue
                schema = strict_schema(version["schema"]["openAPIV3Schema"])
                schema["properties"]["metadata"] = _OBJECT_META
                resource = CustomResource(
                    group=spec["group"],
                    version=version["name"],
                    kind=spec["names"]["kind"],
                    plural=spec["names"]["plural"],
                    validator=jsonschema.Draft7Validator(schema),
                )
                resources[f"{resource.api_version}/{resource.kind}"] = resource
    return resources


def unknown_field_paths(resource: CustomResource, body: dict[str, Any]) -> list[str]:
    """The dotted paths of the fields in `body` its CRD does not declare: what a real API
    server drops without a word (`fieldValidation` Warn, its default since Kubernetes 1.23,
    or Ignore) and refuses with `fieldValidation=Strict`."""
    paths = []
    for error in resource.validator.iter_errors(body):
        if error.validator != "additionalProperties" or not isinstance(error.instance, dict):
            continue
        declared = set(error.schema.get("properties", {}))
        prefix = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        paths += [f"{prefix}.{key}".lstrip(".") for key in error.instance if key not in declared]
    return sorted(paths)


def without_fields(body: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """A copy of `body` with the fields at `paths` (as `unknown_field_paths` writes them) removed:
    what the API server stores when it prunes them."""
    import copy
    import re

    pruned = copy.deepcopy(body)
    for path in paths:
        parts = [int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", path)]
        node: Any = pruned
        for part in parts[:-1]:
            node = node[part]
        node.pop(parts[-1], None)
    return pruned
