"""Every manifest docs/eks.md shows is a file under deploy/eks, and each one is checked here.

Built-in kinds are checked strictly against the `kubernetes` client's models (offline: no
API server runs on these machines); PyTorchJob/TrainJob examples against the upstream CRD
schemas in tests/specs/crds and against a fresh `rtp
render-job` with the command written at the top of the file; the wiring between the
files and the pipeline's defaults (PVC name, secret keys, RBAC for the launcher) too.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from pipelines.platform import DEFAULT_MLFLOW_SECRET, DEFAULT_PVC_NAME, MLFLOW_SECRET_KEYS
from rtp_cli.main import build_parser
from tests.fakes.crd_schema import load_custom_resources
from tests.fakes.k8s_models import core_object_errors

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "eks"
GUIDE = ROOT / "docs" / "eks.md"
CUSTOM_KINDS = {"PyTorchJob", "TrainJob"}


def _objects(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _all_objects() -> list[tuple[str, dict]]:
    return [(path.name, obj) for path in sorted(DEPLOY.glob("*.yaml")) for obj in _objects(path)]


def test_the_guide_shows_only_files_that_exist_and_every_file_is_shown():
    shown = set(re.findall(r"deploy/eks/([\w.-]+\.yaml)", GUIDE.read_text()))
    files = {path.name for path in DEPLOY.glob("*.yaml")}
    assert shown == files


@pytest.mark.parametrize(
    ("name", "obj"), [o for o in _all_objects() if o[1]["kind"] not in CUSTOM_KINDS | {"ClusterConfig"}]
)
def test_builtin_kinds_are_valid_objects(name, obj):
    assert core_object_errors(obj) == [], f"{name}: {obj['kind']} {obj['metadata']['name']}"


@pytest.mark.parametrize("mode", ["pytorchjob", "trainjob"])
def test_job_examples_validate_against_the_crds_and_match_render_job(upstream_specs, mode):
    path = DEPLOY / f"{mode}-example.yaml"
    (manifest,) = _objects(path)
    resource = load_custom_resources(upstream_specs / "crds")[f"{manifest['apiVersion']}/{manifest['kind']}"]
    assert resource.errors(manifest) == []
    command = next(line[2:] for line in path.read_text().splitlines() if line.startswith("# rtp render-job"))
    from rtp_cli.job_commands import render_job

    args = build_parser().parse_args(shlex.split(command)[1:])
    assert render_job(args) == manifest, f"{path.name} is stale: regenerate it with the command at its top"


def test_the_pvc_binds_the_static_fsx_volume_under_the_pipelines_default_name():
    objects = {obj["kind"]: obj for obj in _objects(DEPLOY / "fsx-pv-pvc.yaml")}
    pv, pvc = objects["PersistentVolume"], objects["PersistentVolumeClaim"]
    assert pv["spec"]["csi"]["driver"] == "fsx.csi.aws.com"
    assert {"dnsname", "mountname"} <= set(pv["spec"]["csi"]["volumeAttributes"])
    assert pvc["metadata"]["name"] == DEFAULT_PVC_NAME
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pvc["spec"]["storageClassName"] == ""  # static binding, no dynamic provisioning
    assert pvc["spec"]["accessModes"] == pv["spec"]["accessModes"] == ["ReadWriteMany"]


def test_secrets_are_templates_with_the_keys_the_pipeline_reads_and_no_values():
    secrets = {obj["metadata"]["name"]: obj for obj in _objects(DEPLOY / "mlflow-secrets.yaml")}
    credentials = secrets[DEFAULT_MLFLOW_SECRET]["stringData"]
    assert set(credentials) == set(MLFLOW_SECRET_KEYS)
    assert credentials["username"] == credentials["password"] == ""
    backend = secrets["mlflow-backend"]["stringData"]["backend_store_uri"]
    assert "REPLACE_WITH_PASSWORD" in backend
    for _, obj in _all_objects():
        assert obj["kind"] != "Secret" or "data" not in obj, "base64 data would hide a real value"
    text = "\n".join(path.read_text() for path in DEPLOY.glob("*.yaml"))
    assert not re.search(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b", text) and "aws_secret_access_key" not in text.lower()


def test_rbac_lets_the_pipelines_service_account_run_and_clean_up_jobs():
    objects = {obj["kind"]: obj for obj in _objects(DEPLOY / "pipeline-rbac.yaml")}
    granted = {
        (group, resource, verb)
        for rule in objects["Role"]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    # What components/train/k8s_launcher.py and the exit handler call.
    for plural, group in (("pytorchjobs", "kubeflow.org"), ("trainjobs", "trainer.kubeflow.org")):
        for verb in ("create", "get", "list", "delete"):
            assert (group, plural, verb) in granted
    assert {("", "pods", "list"), ("", "pods/log", "get")} <= granted
    assert ("", "events", "list") in granted  # the stuck-pod watcher reads the scheduler's reasons
    binding = objects["RoleBinding"]
    assert binding["roleRef"]["name"] == objects["Role"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == objects["ServiceAccount"]["metadata"]["name"]
    assert "eks.amazonaws.com/role-arn" in objects["ServiceAccount"]["metadata"]["annotations"]


def test_mlflow_service_selects_the_deployment_and_reads_its_database_from_the_secret():
    objects = {obj["kind"]: obj for obj in _objects(DEPLOY / "mlflow.yaml")}
    deployment, service = objects["Deployment"], objects["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-backend"
    secrets = {obj["metadata"]["name"]: obj for obj in _objects(DEPLOY / "mlflow-secrets.yaml")}
    uri = secrets[DEFAULT_MLFLOW_SECRET]["stringData"]["tracking_uri"]
    assert (
        uri
        == f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local:5000"
    )


def test_mlflow_server_has_auth_a_network_policy_and_no_secret_or_install_in_its_command():
    objects = {obj["kind"]: obj for obj in _objects(DEPLOY / "mlflow.yaml")}
    pod = objects["Deployment"]["spec"]["template"]
    [container] = pod["spec"]["containers"]
    command = " ".join(container.get("command", []) + container.get("args", []))
    assert "--app-name=basic-auth" in command
    assert "pip install" not in command and "MLFLOW_BACKEND_STORE_URI" not in command
    assert "backend-store-uri" not in command  # mlflow reads the variable: no password in argv
    assert container["securityContext"]["runAsNonRoot"] is True
    policy = objects["NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    [rule] = policy["spec"]["ingress"]
    admitted = {
        peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for peer in rule["from"]
    }
    secrets = {obj["metadata"]["name"]: obj for obj in _objects(DEPLOY / "mlflow-secrets.yaml")}
    assert secrets[DEFAULT_MLFLOW_SECRET]["metadata"]["namespace"] in admitted
    assert "[mlflow]" in secrets["mlflow-auth"]["stringData"]["basic_auth.ini"]
    assert "--from-literal=" not in (DEPLOY.parents[1] / "docs" / "eks.md").read_text()


def test_eksctl_cluster_has_oidc_the_fsx_driver_and_an_efa_gpu_group():
    (cluster,) = _objects(DEPLOY / "cluster.yaml")
    assert cluster["apiVersion"] == "eksctl.io/v1alpha5" and cluster["kind"] == "ClusterConfig"
    assert cluster["iam"]["withOIDC"] is True
    assert "aws-fsx-csi-driver" in {addon["name"] for addon in cluster["addons"]}
    gpu = [group for group in cluster["managedNodeGroups"] if group.get("efaEnabled")]
    assert gpu and gpu[0]["instanceType"].startswith("p")
    assert {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"} in gpu[0]["taints"]
