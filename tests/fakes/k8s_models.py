"""Strict checks of core Kubernetes objects (PV, PVC, Secret, RBAC, Deployment, ...) offline.

No API server can run on the development machines, so manifests of built-in kinds are
checked against the `kubernetes` client's models, which are generated from the Kubernetes
OpenAPI spec: every key must be a field of its model (unknown fields rejected, like
`kubectl apply --validate=strict`), and deserializing the object runs the models'
client-side checks of required fields. Enum values and cross-field rules are not covered.
"""

from __future__ import annotations

import re
from typing import Any

from kubernetes import client

_LIST = re.compile(r"^list\[(.+)\]$")
_DICT = re.compile(r"^dict\(str, (.+)\)$")


def model_name(api_version: str, kind: str) -> str:
    version = api_version.split("/")[-1]
    return f"{version[0].upper()}{version[1:]}{kind}"


def unknown_fields(data: Any, type_name: str, path: str = "") -> list[str]:
    """Paths of keys in `data` that the model `type_name` does not define."""
    if (match := _LIST.match(type_name)) and isinstance(data, list):
        return [
            err for i, item in enumerate(data) for err in unknown_fields(item, match.group(1), f"{path}[{i}]")
        ]
    if (match := _DICT.match(type_name)) and isinstance(data, dict):
        return [err for k, v in data.items() for err in unknown_fields(v, match.group(1), f"{path}.{k}")]
    model = getattr(client, type_name, None)
    if model is None or not isinstance(data, dict):
        return []
    by_json_name = {json_name: attr for attr, json_name in model.attribute_map.items()}
    errors = []
    for key, value in data.items():
        if key not in by_json_name:
            errors.append(f"{path}.{key}".lstrip("."))
            continue
        errors += unknown_fields(value, model.openapi_types[by_json_name[key]], f"{path}.{key}")
    return errors


def core_object_errors(obj: dict[str, Any]) -> list[str]:
    """Problems with a built-in Kubernetes object (empty when it checks out)."""
    name = model_name(obj.get("apiVersion", ""), obj.get("kind", ""))
    if not hasattr(client, name):
        return [f"no model {name} for {obj.get('apiVersion')}/{obj.get('kind')}"]
    errors = [f"unknown field {path}" for path in unknown_fields(obj, name)]
    try:
        client.ApiClient()._ApiClient__deserialize(obj, name)
    except (ValueError, TypeError) as exc:
        errors.append(str(exc))
    return errors
