"""Every manifest docs/eks.md shows is a file under deploy/eks, and each one is checked here.

Built-in kinds are checked strictly against the `kubernetes` client's models (offline: no
API server runs on these machines); PyTorchJob/TrainJob examples against the upstream CRD
schemas in tests/specs/crds and against a fresh `rtp
render-job` with the command written at the top of the file; the eksctl cluster against
eksctl's own schema (tests/specs/eksctl); the wiring between the files and the pipeline's
defaults (PVC name, mount path, image user, secret keys, RBAC for the launcher, the GPU
taint the EFA device plugin must tolerate) too.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from pipelines.platform import (
    DEFAULT_FSX_MOUNT_PATH,
    DEFAULT_MLFLOW_SECRET,
    DEFAULT_PVC_NAME,
    MLFLOW_SECRET_KEYS,
)
from rtp_cli.main import build_parser
from tests.fakes.crd_schema import load_custom_resources
from tests.fakes.k8s_models import core_object_errors, unknown_fields

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "eks"
GUIDE = ROOT / "docs" / "eks.md"
CUSTOM_KINDS = {"PyTorchJob", "TrainJob"}
PATCHES = {"efa-device-plugin-patch.yaml"}
"""Patches for objects others create (`kubectl patch --patch-file`): not whole objects,
checked on their own below."""


def _objects(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _all_objects() -> list[tuple[str, dict]]:
    return [
        (path.name, obj)
        for path in sorted(DEPLOY.glob("*.yaml"))
        if path.name not in PATCHES
        for obj in _objects(path)
    ]


def _gpu_group() -> dict:
    (cluster,) = _objects(DEPLOY / "cluster.yaml")
    [gpu] = [group for group in cluster["managedNodeGroups"] if group.get("efaEnabled")]
    return gpu


def test_every_file_is_a_kubernetes_object_or_a_named_patch():
    for name, obj in _all_objects():
        assert {"apiVersion", "kind"} <= set(obj), name
    assert all((DEPLOY / name).is_file() for name in PATCHES)


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
    # Moving a pod off a node that failed the node check: patch the job, delete the pod.
    assert {("kubeflow.org", "pytorchjobs", "patch"), ("", "pods", "delete")} <= granted
    # The stage step's Indexed Job of part pods (stage_workers > 1).
    assert {("batch", "jobs", verb) for verb in ("create", "get", "delete")} <= granted
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


def test_eksctl_cluster_matches_eksctls_schema(upstream_specs):
    import json

    import jsonschema

    schema = json.loads((upstream_specs / "eksctl" / "schema.v0.230.0.json").read_text())
    (cluster,) = _objects(DEPLOY / "cluster.yaml")
    errors = [f"{list(e.path)}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(cluster)]
    assert errors == []


def test_the_gpu_group_scales_from_zero_and_tells_the_autoscaler_what_a_node_offers():
    gpu = _gpu_group()
    assert gpu["minSize"] == gpu["desiredCapacity"] == 0 < gpu["maxSize"]  # no p5 idles without a job
    assert gpu["propagateASGTags"] is True  # labels, taints and tags reach the ASG
    tags = gpu["tags"]
    template = "k8s.io/cluster-autoscaler/node-template/"
    for key, value in gpu["labels"].items():
        assert tags[f"{template}label/{key}"] == value
    for taint in gpu["taints"]:  # the autoscaler reads "<value>:<effect>"
        assert tags[f"{template}taint/{taint['key']}"] == f"{taint['value']}:{taint['effect']}"
    # A node from the template must fit the example job's pod, or the autoscaler never adds one.
    (job,) = _objects(DEPLOY / "pytorchjob-example.yaml")
    limits = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resources"][
        "limits"
    ]
    for resource in ("nvidia.com/gpu", "vpc.amazonaws.com/efa"):
        assert int(tags[f"{template}resources/{resource}"]) >= int(limits[resource])
    (cluster,) = _objects(DEPLOY / "cluster.yaml")
    system = next(group for group in cluster["managedNodeGroups"] if not group.get("efaEnabled"))
    assert system["iam"]["withAddonPolicies"]["autoScaler"] is True  # the autoscaler may resize the ASG


def _tolerates(toleration: dict, taint: dict) -> bool:
    """Kubernetes' rule: key (or an empty key with Exists), operator, value, effect (empty = any)."""
    if toleration.get("effect") and toleration["effect"] != taint["effect"]:
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint["key"]
    return toleration.get("key") == taint["key"] and toleration.get("value", "") == taint.get("value", "")


def test_the_efa_device_plugin_tolerates_every_taint_of_the_gpu_nodes():
    """eksctl (v0.230.0, pkg/addons/assets/efa-device-plugin.yaml) installs the plugin's
    DaemonSet itself for an efaEnabled group, tolerating CriticalAddonsOnly and
    aws.amazon.com/efa; the guide patches that DaemonSet rather than installing a second."""
    patch = yaml.safe_load((DEPLOY / "efa-device-plugin-patch.yaml").read_text())
    tolerations = patch["spec"]["template"]["spec"]["tolerations"]
    daemon_set = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "x"}, **patch}
    assert unknown_fields(daemon_set, "V1DaemonSet") == []
    assert all(unknown_fields(t, "V1Toleration") == [] for t in tolerations)
    for taint in _gpu_group()["taints"]:
        assert any(_tolerates(t, taint) for t in tolerations), (
            f"the plugin never runs on nodes tainted {taint}"
        )
    # A strategic merge patch replaces the list: eksctl's own tolerations must stay in it.
    for kept in ({"key": "CriticalAddonsOnly", "operator": "Exists"},
                 {"key": "aws.amazon.com/efa", "operator": "Exists", "effect": "NoSchedule"}):  # fmt: skip
        assert kept in tolerations
    commands = _guide_commands()
    assert not [c for c in commands if c[:2] == ["helm", "install"] and "aws-efa-k8s-device-plugin" in c]
    patch_command = next(c for c in commands if c[:1] == ["kubectl"] and "patch" in c and "daemonset" in c)
    assert _flag(patch_command, "--patch-file") == "deploy/eks/efa-device-plugin-patch.yaml"
    assert "aws-efa-k8s-device-plugin" in patch_command and _flag(patch_command, "-n") == "kube-system"


def test_the_fsx_security_group_opens_every_lustre_port_in_the_guide():
    """FSx for Lustre user guide, "File system access control with Amazon VPC": TCP 988 and
    1018-1023, from the file system's own security group and from its clients'."""
    commands = [line for line in GUIDE.read_text().splitlines() if "authorize-security-group-ingress" in line]
    assert commands
    loop = re.search(r"for port in ([^;]+); do for source in ([^;]+); do", "\n".join(commands))
    assert loop, commands
    assert set(loop.group(1).split()) == {"988", "1018-1023"}
    assert set(loop.group(2).split()) == {"$FSX_SG", "$NODE_SG"}


def test_the_fsx_init_job_creates_the_pipelines_folder_for_the_images_user():
    from components.layout import dataset_root
    from components.stage_data.fs_safety import FSX_INIT_JOB
    from components.train.jobs import RUN_AS_USER

    assert (ROOT / FSX_INIT_JOB).is_file()  # what the stage step's permission error tells to run
    (job,) = _objects(ROOT / FSX_INIT_JOB)
    pod = job["spec"]["template"]
    spec = pod["spec"]
    [container] = spec["containers"]
    [mount] = container["volumeMounts"]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == DEFAULT_PVC_NAME
    assert mount["mountPath"] == DEFAULT_FSX_MOUNT_PATH  # what every step mounts (rtp compile default)
    pvc = next(o for o in _objects(DEPLOY / "fsx-pv-pvc.yaml") if o["kind"] == "PersistentVolumeClaim")
    assert job["metadata"]["namespace"] == pvc["metadata"]["namespace"]
    folder = str(dataset_root(DEFAULT_FSX_MOUNT_PATH, "x").parents[1])  # <mount>/rtp
    script = container["command"][-1]
    uid_gid = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert uid_gid and int(uid_gid.group(1)) == RUN_AS_USER
    assert (
        f"mkdir -p {folder}" in script and f"chown {uid_gid.group(1)}:{uid_gid.group(2)} {folder}" in script
    )
    assert script.index("chmod") < script.index("chown")  # root without CAP_FOWNER cannot chmod 1000's folder
    assert spec["securityContext"]["runAsUser"] == 0 and spec["restartPolicy"] == "Never"
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"  # or the Job never completes


def test_the_job_namespace_template_grants_the_pipelines_account_what_it_has_at_home():
    home = {obj["kind"]: obj for obj in _objects(DEPLOY / "pipeline-rbac.yaml")}
    other = {obj["kind"]: obj for obj in _objects(DEPLOY / "job-namespace-rbac.yaml")}
    namespace = other["Namespace"]["metadata"]["name"]
    assert namespace != home["Role"]["metadata"]["namespace"]
    assert (
        other["Role"]["metadata"]["namespace"] == other["RoleBinding"]["metadata"]["namespace"] == namespace
    )
    assert other["Role"]["rules"] == home["Role"]["rules"]  # the same calls, in the job namespace
    assert other["RoleBinding"]["roleRef"]["name"] == other["Role"]["metadata"]["name"]
    [subject] = other["RoleBinding"]["subjects"]
    account = home["ServiceAccount"]["metadata"]
    assert (subject["kind"], subject["name"], subject["namespace"]) == (
        "ServiceAccount",
        account["name"],
        account["namespace"],
    )


def _guide_rows(heading: str) -> dict[str, list[str]]:
    """The cells of the first table under `heading` in the guide, by first cell."""
    section = GUIDE.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows)}


def _numbers(cell: str) -> list[float]:
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?", cell)]


def test_the_guides_timeout_table_is_the_one_the_code_applies():
    from components.train.job_scale import job_scale, trainer_overrides
    from trainer.config import ResilienceConfig

    rows = _guide_rows("Timeouts and restarts on GPUs")
    cpu, gpu = job_scale(0), job_scale(8)
    gpu_trainer = {
        k.removeprefix("resilience."): float(v) for k, v in (o.split("=") for o in trainer_overrides(8))
    }
    expected = {
        "collective timeout": ([cpu.collective_timeout_s], [gpu.collective_timeout_s]),
        "in-process soft / hard timeout, learned between floor / ceiling": (
            [ResilienceConfig().timeout_floor_s, ResilienceConfig().timeout_ceiling_s],
            [gpu_trainer["timeout_floor_s"], gpu_trainer["timeout_ceiling_s"]],
        ),
        "blocking checkpoint work kept alive": (
            [ResilienceConfig().blocking_work_limit_s],
            [gpu_trainer["blocking_work_limit_s"]],
        ),
        "ft_launcher heartbeat floor": ([cpu.heartbeat_floor_s], [gpu.heartbeat_floor_s]),
        "ft_launcher `--max-restarts`": ([cpu.max_restarts], [gpu.max_restarts]),
        "PyTorchJob `backoffLimit`": ([cpu.backoff_limit], [gpu.backoff_limit]),
        "`terminationGracePeriodSeconds`": ([cpu.termination_grace_s], [gpu.termination_grace_s]),
    }
    for label, (on_cpu, on_gpu) in expected.items():
        cells = rows[label]
        assert (_numbers(cells[0]), _numbers(cells[1])) == (on_cpu, on_gpu), label


def test_the_guide_lists_every_preset_and_says_to_set_source():
    from trainer.config import PRESETS

    rows = _guide_rows("8. Compile, upload, run and schedule")
    presets = set(re.findall(r"`([\w-]+)`", rows["`preset`, `overrides`"][1]))
    assert set(PRESETS) <= presets
    assert "set it" in rows["`source`"][1]
    walkthrough = GUIDE.read_text().split("\n## A two-node p5 run, step by step\n", 1)[1].split("\n## ", 1)[0]
    assert "`source=s3://" in walkthrough


# ---------------------------------------------------------------- the guide, walked through


PRE_EXISTING_NAMESPACES = {"kube-system", "kubeflow"}
"""Namespaces the cluster has before the guide's first command (EKS; Kubeflow's own)."""


def _guide_commands() -> list[list[str]]:
    """Every simple command of the guide's fenced bash blocks, in order, as words: continued
    lines joined, comments dropped, split at `&&`, `||`, `;` and `|`."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), re.S)
    commands: list[list[str]] = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            current: list[str] = []
            for word in lexer:
                if word in (";", "&&", "||", "|", "&"):
                    commands.append(current) if current else None
                    current = []
                else:
                    current.append(word)
            if current:
                commands.append(current)
    return [c for c in commands if c]


def _flag(command: list[str], name: str) -> str | None:
    """The value of `name` in `command` (`--name value` or `--name=value`)."""
    for i, word in enumerate(command):
        if word == name and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(f"{name}="):
            return word.split("=", 1)[1]
    return None


def _subcommand_options() -> dict[str, set[str]]:
    import argparse

    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {
        name: {option for action in child._actions for option in action.option_strings}
        for name, child in sub.choices.items()
    }


def test_every_guide_command_names_files_and_flags_that_exist():
    options = _subcommand_options()
    commands = _guide_commands()
    assert len(commands) > 40
    for command in commands:
        for word in command:
            for path in re.findall(r"(?:^|=)((?:deploy|docs)/[\w./-]+)", word):
                assert (ROOT / path).exists(), f"{path} in: {shlex.join(command)}"
        if command[0] == ".venv/bin/rtp":
            name = command[1]
            assert name in options, f"rtp has no {name}: {shlex.join(command)}"
            flags = {w.split("=", 1)[0] for w in command[2:] if w.startswith("--")}
            assert flags <= options[name], f"rtp {name} has no {flags - options[name]}"


def _namespaced(obj: dict) -> str | None:
    return obj.get("metadata", {}).get("namespace")


def _secrets_read(obj: dict) -> set[str]:
    """The secrets a (pod-carrying) object's pod template reads."""
    template = obj.get("spec", {}).get("template", {}).get("spec", {})
    names = {v["secret"]["secretName"] for v in template.get("volumes", []) if "secret" in v}
    for container in template.get("containers", []):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
    return names


def test_the_guide_creates_every_namespace_and_secret_before_it_is_used():
    """Walks the guide's commands in order: nothing goes into a namespace before a step has
    made it (a Kubeflow profile's, by the profile controller, is waited for, never created by
    hand), and every secret a workload reads exists before the workload is applied."""
    namespaces = set(PRE_EXISTING_NAMESPACES)
    secrets: set[tuple[str, str]] = set()
    profile = "kubeflow-user-example-com"
    applied = []
    for command in _guide_commands():
        if command[0] != "kubectl":
            continue
        namespace = _flag(command, "-n") or _flag(command, "--namespace")
        words = [
            w
            for i, w in enumerate(command[1:])
            if w not in ("-n", "--namespace") and command[i] not in ("-n", "--namespace")
        ]
        if words[:2] == ["create", "namespace"]:
            assert words[2] != profile, "the profile controller refuses a namespace it did not create"
            namespaces.add(words[2])
            continue
        if "wait" in words and "--for=create" in words and any(w.startswith("namespace/") for w in words):
            namespaces.add(next(w for w in words if w.startswith("namespace/")).split("/", 1)[1])
            continue
        if namespace and "port-forward" not in words:
            assert namespace in namespaces, f"namespace {namespace} does not exist yet: {shlex.join(command)}"
        if words[:3] == ["create", "secret", "generic"]:
            secrets.add((namespace or "default", words[3]))
        if words[:1] == ["apply"] and _flag(command, "-f"):
            path = ROOT / _flag(command, "-f")
            applied.append(path.name)
            objects = _objects(path)
            namespaces |= {o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"}
            for obj in objects:
                if _namespaced(obj):
                    assert _namespaced(obj) in namespaces, (
                        f"{path.name}: {_namespaced(obj)} does not exist yet"
                    )
                    for secret in _secrets_read(obj):
                        assert (_namespaced(obj), secret) in secrets, (
                            f"{path.name} reads {secret} before it exists"
                        )
    assert {"fsx-pv-pvc.yaml", "fsx-init-job.yaml", "mlflow.yaml", "pipeline-rbac.yaml"} <= set(applied)
    assert ("kubeflow-user-example-com", DEFAULT_MLFLOW_SECRET) in secrets


def test_the_guides_secrets_are_written_without_a_line_end():
    """`kubectl create secret --from-file` keeps a file's final newline in the value; the
    guide writes every value with printf '%s', never echo or an editor."""
    text = GUIDE.read_text()
    assert "printf '%s'" in text
    for command in _guide_commands():
        assert command[0] != "echo", shlex.join(command)


def test_the_mlflow_server_is_reachable_by_its_service_name_and_can_run_basic_auth():
    objects = {obj["kind"]: obj for obj in _objects(DEPLOY / "mlflow.yaml")}
    [container] = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    service = objects["Service"]["metadata"]
    allowed = _flag(container["command"], "--allowed-hosts")
    assert allowed, "MLflow >= 3.5 answers 403 to a Host outside --allowed-hosts"
    secrets = {obj["metadata"]["name"]: obj for obj in _objects(DEPLOY / "mlflow-secrets.yaml")}
    host = secrets[DEFAULT_MLFLOW_SECRET]["stringData"]["tracking_uri"].split("://", 1)[1]
    assert host in allowed.split(","), host  # the Host header the pipeline's client sends
    assert f"{service['name']}.{service['namespace']}.svc.cluster.local:5000" in allowed.split(",")
    dockerfile = (DEPLOY / "mlflow.Dockerfile").read_text()
    assert re.search(r"mlflow\[auth\]==", dockerfile), (
        "--app-name basic-auth imports Flask-WTF (mlflow[auth])"
    )
    for name in ("mlflow-backend", "mlflow-auth"):
        text = yaml.safe_dump(secrets[name]["stringData"])
        assert (
            "postgresql+psycopg2://" in text and "postgresql://" not in text
        )  # psycopg2 is what the image has


def test_the_cluster_names_its_zones_and_puts_the_gpu_nodes_in_private_subnets():
    (cluster,) = _objects(DEPLOY / "cluster.yaml")
    gpu = _gpu_group()
    zones = cluster["availabilityZones"]
    assert len(zones) >= 2 and gpu["availabilityZones"] == zones[:1]  # the p5 capacity's zone first
    assert gpu["privateNetworking"] is True  # no public IP with more than one network interface
    accelerator = "k8s.amazonaws.com/accelerator"  # the cluster autoscaler's AWS GPULabel
    assert (
        gpu["tags"][f"k8s.io/cluster-autoscaler/node-template/label/{accelerator}"]
        == gpu["labels"][accelerator]
    )
    vpc_cni = next(a for a in cluster["addons"] if a["name"] == "vpc-cni")
    assert '"enableNetworkPolicy": "true"' in vpc_cni["configurationValues"]


def test_the_fsx_init_job_can_run_again():
    """Once the folder is 1000's, root without CAP_FOWNER may not chmod it: a second run must
    leave it alone rather than fail."""
    (job,) = _objects(DEPLOY / "fsx-init-job.yaml")
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    guard = script.index("!= 1000")
    assert guard < script.index("chmod") < script.index("chown")


def test_efa_jobs_have_a_namespace_whose_pod_security_admits_ipc_lock():
    other = {obj["kind"]: obj for obj in _objects(DEPLOY / "job-namespace-rbac.yaml")}
    labels = other["Namespace"]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"  # baseline refuses IPC_LOCK
