"""`rtp upload | run | schedule | runs` through kfp.Client against a FAKE KFP v2beta1 API.

The real API server cannot run here (tests/fakes/kfp_api.py says why); the fake keeps
state, checks every request against the upstream swagger in tests/specs and parses
every uploaded pipeline into kfp's PipelineSpec proto.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import kfp
import pytest

from components.versioning import source_identity
from pipelines.pipeline import compile_pipeline
from rtp_cli import kfp_checks
from rtp_cli.main import main
from tests.fakes.kfp_api import FakeKfpApi

pytestmark = [pytest.mark.timeout(120)]

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    return Path(compile_pipeline(str(tmp_path_factory.mktemp("package") / "pipeline.yaml")))


@pytest.fixture(autouse=True)
def isolated_environment(monkeypatch, tmp_path):
    """No token, namespace, endpoint or kfp context from the developer's machine leaks in."""
    for name in (
        kfp_checks.TOKEN_ENV,
        kfp_checks.NAMESPACE_ENV,
        kfp_checks.ENDPOINT_ENV,
        "KF_PIPELINES_UI_ENDPOINT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(kfp_checks.TOKEN_PATH_ENV, str(tmp_path / "no-token-here"))
    # No cluster either: the version check reads the API server's image only where a test says.
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig-here"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))


def _start(upstream_specs: Path, **options) -> FakeKfpApi:
    fake = FakeKfpApi(upstream_specs / "kfp-v2beta1", **options)
    fake.start()
    return fake


@pytest.fixture
def kfp_api(upstream_specs):
    fake = _start(upstream_specs)
    yield fake
    fake.stop()
    assert fake.errors == [], "the fake answered outside the swagger (a bug in the fake)"


def rtp(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _upload(capsys, fake, package, *extra):
    return rtp(capsys, "upload", "--host", fake.url, "--package", str(package), *extra)


# --- the fake itself is strict ---------------------------------------------------------------


def test_fake_rejects_what_the_real_api_would(kfp_api, package):
    import urllib.error
    import urllib.request

    def post(path, body):
        request = urllib.request.Request(
            kfp_api.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    status, answer = post("/apis/v2beta1/runs", {"display_name": "x", "bogus": 1})
    assert status == 400 and "unknown field 'bogus'" in answer["message"]
    status, answer = post("/apis/v2beta1/experiments", {"display_name": 5})
    assert status == 400 and "expected a string" in answer["message"]
    status, answer = post(
        "/apis/v2beta1/runs",
        {"display_name": "x", "pipeline_spec": {"pipelineInfo": {"name": "p"}, "nope": {}}},
    )
    assert status == 400 and "invalid pipeline spec" in answer["message"]
    status, _ = post("/apis/v2beta1/nothing-here", {})
    assert status == 404


# --- upload -----------------------------------------------------------------------------------


def test_first_upload_creates_the_pipeline_with_a_named_version(kfp_api, package, capsys):
    code, out, _ = rtp(capsys, "upload", "--host", kfp_api.url)  # compiles this checkout
    assert code == 0, out
    [pipeline] = kfp_api.pipelines.values()
    [version] = kfp_api.versions.values()
    assert pipeline["display_name"] == "rtp-resilient-training"
    package_version, commit, dirty = source_identity()
    spec_sha256 = hashlib.sha256(package.read_bytes()).hexdigest()  # compiling is deterministic
    assert version["name"] == kfp_checks.default_version_name(package_version, commit, dirty, spec_sha256)
    assert version["name"].startswith(package_version + (f"-{commit}" if commit else ""))
    stored = version["pipeline_spec"]  # {pipeline_spec, platform_spec} when a platform spec exists
    assert set(stored) == {"pipeline_spec", "platform_spec"}
    assert stored["pipeline_spec"]["pipelineInfo"]["name"] == "rtp-resilient-training"
    assert kfp_checks.spec_sha256_in(version["description"]), "the spec hash is recorded for repeat detection"
    assert f"created pipeline 'rtp-resilient-training' with version '{version['name']}'" in out
    assert f"/#/pipelines/details/{pipeline['pipeline_id']}/version/{version['pipeline_version_id']}" in out


def test_new_version_and_repeated_upload(kfp_api, package, capsys):
    assert _upload(capsys, kfp_api, package, "--version", "v1")[0] == 0
    code, out, _ = _upload(capsys, kfp_api, package, "--version", "v2")
    assert code == 0 and "uploaded version 'v2'" in out
    assert len(kfp_api.pipelines) == 1
    assert sorted(v["name"] for v in kfp_api.versions.values()) == ["v1", "v2"]

    uploads_before = len(kfp_api.sent("POST", "/apis/v2beta1/pipelines/upload"))
    code, out, _ = _upload(capsys, kfp_api, package, "--version", "v2")
    assert code == 0
    assert "already has version 'v2' with this spec; nothing uploaded" in out
    assert len(kfp_api.sent("POST", "/apis/v2beta1/pipelines/upload")) == uploads_before
    assert len(kfp_api.versions) == 2


def test_reusing_a_version_name_for_another_spec_is_refused(kfp_api, package, capsys, tmp_path):
    assert _upload(capsys, kfp_api, package, "--version", "v1")[0] == 0
    changed = tmp_path / "changed.yaml"
    text = package.read_text()
    assert "defaultValue: 40.0" in text
    changed.write_text(text.replace("defaultValue: 40.0", "defaultValue: 41.0", 1))
    code, _, err = _upload(capsys, kfp_api, changed, "--version", "v1")
    assert code == 2
    assert "already has a version 'v1' with a different spec" in err and "--version" in err
    assert len(kfp_api.versions) == 1


def test_uploading_something_that_is_not_a_pipeline_is_refused_before_any_request(kfp_api, capsys, tmp_path):
    bogus = tmp_path / "not-a-pipeline.yaml"
    bogus.write_text("hello: world\n")
    code, _, err = _upload(capsys, kfp_api, bogus)
    assert code == 2 and "not a compiled KFP pipeline" in err
    assert kfp_api.requests == []


# --- the backend's version (healthz tag_name) --------------------------------------------------


@pytest.fixture
def old_backend(upstream_specs):
    fake = _start(upstream_specs, tag_name="2.4.1")
    yield fake
    fake.stop()
    assert fake.errors == []


def test_the_fake_answers_healthz_with_the_servers_version_fields(kfp_api):
    import urllib.request

    with urllib.request.urlopen(kfp_api.url + "/apis/v2beta1/healthz", timeout=10) as response:
        answer = json.loads(response.read())
    assert answer["tag_name"] == "2.17.0" and answer["commit_sha"] and answer["multi_user"] is False
    assert kfp_api.errors == []


def test_an_older_backend_is_refused_in_one_line_before_anything_is_sent(old_backend, package, capsys):
    for argv in (
        ("upload", "--host", old_backend.url, "--package", str(package)),
        ("run", "--host", old_backend.url, "--package", str(package)),
        (
            "schedule",
            "--host",
            old_backend.url,
            "--package",
            str(package),
            "--name",
            "n",
            "--cron",
            "0 3 * * *",
        ),
    ):
        code, out, err = rtp(capsys, *argv)
        assert code == 2, out
        [line] = err.strip().splitlines()
        assert (
            "is 2.4.1 (healthz tag_name '2.4.1') but rtp's pipeline needs 2.5.0 or later" in line
            and "upgrade Kubeflow Pipelines" in line
        )
    assert old_backend.pipelines == {} and old_backend.runs == {} and old_backend.recurring_runs == {}
    assert {r["path"] for r in old_backend.requests} == {"/apis/v2beta1/healthz"}


def test_reading_and_deleting_still_work_on_an_older_backend(old_backend, package, capsys):
    code, out, err = rtp(capsys, "runs", "--host", old_backend.url)
    assert code == 0 and err == "", err
    code, out, err = rtp(
        capsys, "schedule", "--host", old_backend.url, "--package", str(package), "--name", "n", "--delete"
    )
    assert code == 0 and "nothing to delete" in out and err == ""


def test_a_backend_that_honours_every_retry_is_accepted_without_a_warning(upstream_specs, package, capsys):
    fake = _start(upstream_specs, tag_name="2.14.0")
    try:
        code, out, err = _upload(capsys, fake, package, "--version", "v1")
    finally:
        fake.stop()
    assert code == 0 and "created pipeline" in out
    assert err == ""


def test_a_backend_before_2_14_is_told_it_drops_the_retries(upstream_specs, package, capsys):
    fake = _start(upstream_specs, tag_name="2.5.0")
    try:
        code, out, err = _upload(capsys, fake, package, "--version", "v1")
    finally:
        fake.stop()
    assert code == 0 and "created pipeline" in out
    [line] = err.strip().splitlines()
    assert line.startswith("rtp upload: warning: the Kubeflow Pipelines backend at")
    # The compiled pipeline's retried tasks, all inside the exit handler or the condition.
    assert "drops the retries of register-model, stage-data, stage-model" in line and "2.14.0" in line


@pytest.mark.parametrize("tag_name", ["unknown", "master", None])
def test_an_unreadable_version_warns_and_goes_on(upstream_specs, package, capsys, tag_name):
    fake = _start(upstream_specs, tag_name=tag_name)
    try:
        code, out, err = rtp(capsys, "run", "--host", fake.url, "--package", str(package))
    finally:
        fake.stop()
    assert code == 0 and "started run" in out
    [line] = err.strip().splitlines()
    assert line.startswith("rtp run: warning: cannot tell the Kubeflow Pipelines version")
    assert "needs 2.5.0 or later" in line and len(fake.runs) == 1
    assert "no kubeconfig" in line and "need 2.14.0 or later" in line


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "fake", "user": {"token": "t"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    return path


@pytest.fixture
def release_image_cluster(upstream_specs, monkeypatch, tmp_path):
    """A release build's backend: healthz says `unknown` (KFP 2.5.0-2.15.x images do), and the
    cluster in the kubeconfig runs its API server (a FAKE Kubernetes API, tests/fakes)."""
    from tests.fakes.kube_api import FakeKubernetes

    fake = _start(upstream_specs, tag_name="unknown")
    with FakeKubernetes(upstream_specs / "crds") as cluster:
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "kubeconfig", cluster.url)))
        yield fake, cluster
    fake.stop()


def _api_server(cluster, tag: str) -> None:
    cluster.add_deployment(
        "kubeflow", "ml-pipeline", {"ml-pipeline-api-server": f"ghcr.io/kubeflow/kfp-api-server:{tag}"}
    )


def test_the_api_server_image_refuses_an_old_release_healthz_hides(release_image_cluster, package, capsys):
    fake, cluster = release_image_cluster
    _api_server(cluster, "2.4.1")
    code, out, err = rtp(capsys, "run", "--host", fake.url, "--package", str(package))
    assert code == 2, out
    [line] = err.strip().splitlines()
    assert "is 2.4.1 (API server image ghcr.io/kubeflow/kfp-api-server:2.4.1)" in line
    assert fake.runs == {}


def test_the_api_server_image_says_a_release_drops_the_retries(release_image_cluster, package, capsys):
    fake, cluster = release_image_cluster
    _api_server(cluster, "2.5.0")
    code, out, err = rtp(capsys, "run", "--host", fake.url, "--package", str(package))
    assert code == 0 and "started run" in out
    [line] = err.strip().splitlines()
    assert "is 2.5.0 (API server image" in line and "drops the retries of register-model" in line


def test_the_api_server_image_of_a_new_release_needs_no_warning(release_image_cluster, package, capsys):
    fake, cluster = release_image_cluster
    _api_server(cluster, "2.15.0")
    code, out, err = rtp(capsys, "run", "--host", fake.url, "--package", str(package))
    assert code == 0 and "started run" in out and err == ""


def test_an_unreadable_api_server_image_says_why(release_image_cluster, package, capsys):
    fake, cluster = release_image_cluster
    _api_server(cluster, "2.15.0")
    cluster.forbidden.add("get-deployment")  # a profile user's token may not read kubeflow's objects
    code, out, err = rtp(capsys, "run", "--host", fake.url, "--package", str(package))
    assert code == 0 and "started run" in out
    [line] = err.strip().splitlines()
    assert "cannot tell" in line and "403 Forbidden for deployment kubeflow/ml-pipeline" in line


# --- run --------------------------------------------------------------------------------------


def test_run_of_an_uploaded_version_with_typed_parameters(kfp_api, package, capsys):
    assert _upload(capsys, kfp_api, package, "--version", "v1")[0] == 0
    code, out, _ = rtp(
        capsys, "run", "--host", kfp_api.url, "--package", str(package), "--version", "v1",
        "--param", "steps=200", "--param", "checkpoint_mode=sync", "--param", "max_loss=3.5",
        "--experiment", "nightly-tests",
    )  # fmt: skip
    assert code == 0, out
    [run] = kfp_api.runs.values()
    assert run["runtime_config"]["parameters"] == {"steps": 200, "checkpoint_mode": "sync", "max_loss": 3.5}
    [version] = kfp_api.versions.values()
    assert run["pipeline_version_reference"]["pipeline_version_id"] == version["pipeline_version_id"]
    assert kfp_api.experiments[run["experiment_id"]]["display_name"] == "nightly-tests"
    assert f"/#/runs/details/{run['run_id']}" in out


def test_run_of_the_local_package_sends_its_spec(kfp_api, package, capsys):
    code, out, _ = rtp(capsys, "run", "--host", kfp_api.url, "--package", str(package), "--param", "nproc=1")
    assert code == 0, out
    [run] = kfp_api.runs.values()
    assert (
        run["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "rtp-resilient-training"
    )  # parsed strictly by the fake
    assert run["runtime_config"]["parameters"] == {"nproc": 1}


@pytest.mark.parametrize(
    ("argument", "needles"),
    [
        ("stepz=10", ["unknown pipeline parameter 'stepz'", "steps", "checkpoint_mode"]),
        ("steps=ten", ["steps", "an integer"]),
        ("checkpoint_mode=fast", ["checkpoint_mode", "off, sync, async"]),
    ],
)
def test_bad_parameters_are_rejected_before_any_request(kfp_api, package, capsys, argument, needles):
    code, _, err = rtp(capsys, "run", "--host", kfp_api.url, "--package", str(package), "--param", argument)
    assert code == 2
    for needle in needles:
        assert needle in err
    assert kfp_api.requests == []


def test_wait_follows_the_run_and_fails_when_it_fails(kfp_api, package, capsys):
    base = ["run", "--host", kfp_api.url, "--package", str(package), "--wait", "--poll-s", "0.01"]
    code, out, _ = rtp(capsys, *base)
    assert code == 0
    assert out.splitlines()[-1].endswith("SUCCEEDED")
    kfp_api.run_outcome = "FAILED"
    code, out, err = rtp(capsys, *base)
    assert code == 1
    assert "RUNNING" in out and out.splitlines()[-1].endswith("FAILED")
    assert "ended FAILED" in err and "/#/runs/details/" in err


def test_runs_lists_state_duration_and_metrics_from_the_shared_volume(kfp_api, package, capsys, tmp_path):
    rtp(capsys, "run", "--host", kfp_api.url, "--package", str(package), "--param", "run_name=nightly-1")
    [run] = kfp_api.runs.values()
    steps = tmp_path / "fsx" / "rtp" / "runs" / "nightly-1" / "steps"
    steps.mkdir(parents=True)
    (steps / "train.json").write_text(json.dumps({"final_loss": 2.125}))
    (steps / "validate.json").write_text(json.dumps({"holdout_loss": 2.375, "decision": "champion"}))
    (steps / "stage_model.json").write_text(
        json.dumps({"registry": {"model_name": "rtp-model", "version": "3"}})
    )
    code, out, _ = rtp(capsys, "runs", "--host", kfp_api.url, "--fsx-mount-path", str(tmp_path / "fsx"))
    assert code == 0
    header, row = out.strip().splitlines()
    assert "state" in header and "duration" in header and "holdout_loss" in header and "parent" in header
    assert (
        " v3 " in row
        and run["run_id"] in row
        and "PENDING" in row
        and "2.1250" in row
        and "2.3750" in row
        and "champion" in row
    )


# --- schedule -------------------------------------------------------------------------------


def _schedule(capsys, fake, package, *extra):
    return rtp(capsys, "schedule", "--host", fake.url, "--package", str(package), "--name", "nightly", *extra)


def test_schedule_create_update_disable_enable_delete(kfp_api, package, capsys):
    assert _upload(capsys, kfp_api, package, "--version", "v1")[0] == 0

    code, out, _ = _schedule(capsys, kfp_api, package, "--cron", "0 3 * * *", "--param", "steps=80")
    assert code == 0 and "created recurring run 'nightly'" in out
    [created] = kfp_api.recurring_runs.values()
    assert created["trigger"]["cron_schedule"]["cron"] == "0 0 3 * * *"  # 5 fields converted
    assert created["max_concurrency"] == "1" and created["no_catchup"] is True
    assert created["runtime_config"]["parameters"] == {"steps": 80}
    assert created["status"] == "ENABLED"

    code, out, _ = _schedule(capsys, kfp_api, package, "--cron", "0 3 * * *", "--param", "steps=80")
    assert code == 0 and "already matches" in out
    assert list(kfp_api.recurring_runs) == [created["recurring_run_id"]]

    code, out, _ = _schedule(capsys, kfp_api, package, "--disable")
    assert code == 0 and "disabled" in out
    assert kfp_api.recurring_runs[created["recurring_run_id"]]["status"] == "DISABLED"

    code, out, _ = _schedule(capsys, kfp_api, package, "--interval", "6h", "--param", "steps=80")
    assert code == 0 and "replaced recurring run 'nightly'" in out
    [updated] = kfp_api.recurring_runs.values()
    assert updated["recurring_run_id"] != created["recurring_run_id"]
    assert updated["trigger"]["periodic_schedule"]["interval_second"] == "21600"
    assert updated["status"] == "DISABLED", "redefining a disabled schedule keeps it disabled"

    code, out, _ = _schedule(capsys, kfp_api, package, "--enable")
    assert code == 0 and kfp_api.recurring_runs[updated["recurring_run_id"]]["status"] == "ENABLED"

    code, out, _ = _schedule(capsys, kfp_api, package, "--delete")
    assert code == 0 and "deleted" in out and kfp_api.recurring_runs == {}
    code, out, _ = _schedule(capsys, kfp_api, package, "--delete")
    assert code == 0 and "nothing to delete" in out


def test_schedule_pins_the_newest_version_and_follows_a_new_upload(kfp_api, package, capsys):
    assert _upload(capsys, kfp_api, package, "--version", "v1")[0] == 0
    assert _schedule(capsys, kfp_api, package, "--cron", "0 0 3 * * *")[0] == 0
    assert _upload(capsys, kfp_api, package, "--version", "v2")[0] == 0
    code, out, _ = _schedule(capsys, kfp_api, package, "--cron", "0 0 3 * * *")
    assert code == 0 and "replaced" in out and "version v2" in out
    [recurring] = kfp_api.recurring_runs.values()
    v2 = next(v for v in kfp_api.versions.values() if v["name"] == "v2")
    assert recurring["pipeline_version_reference"]["pipeline_version_id"] == v2["pipeline_version_id"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--cron", "0 3 * *"], "4 fields"),
        (["--cron", "0 3 * * 7"], "use 0 for Sunday"),
        (["--interval", "soon"], "interval 'soon'"),
        (["--cron", "0 3 * * *", "--max-concurrency", "0"], "1-10"),
        (["--cron", "0 3 * * *", "--param", "preset=huge"], "tiny-cpu"),
        ([], "--cron or --interval"),
    ],
)
def test_bad_schedules_are_rejected_before_any_request(kfp_api, package, capsys, extra, needle):
    code, _, err = _schedule(capsys, kfp_api, package, *extra)
    assert code == 2 and needle in err
    assert kfp_api.requests == []


def test_schedule_of_a_pipeline_never_uploaded_says_to_upload(kfp_api, package, capsys):
    code, _, err = _schedule(capsys, kfp_api, package, "--cron", "0 3 * * *")
    assert code == 2 and "rtp upload" in err


# --- auth -------------------------------------------------------------------------------------


@pytest.fixture
def secured_api(upstream_specs):
    fake = _start(upstream_specs, token=TOKEN, namespaces={"team-a"})
    yield fake
    fake.stop()
    assert fake.errors == []


def test_missing_or_wrong_token_gives_a_clear_401_message(secured_api, package, capsys, monkeypatch):
    code, _, err = _upload(capsys, secured_api, package, "--namespace", "team-a")
    assert code == 2
    assert "401" in err and "no token" in err and "--token-file" in err and "Traceback" not in err
    monkeypatch.setenv(kfp_checks.TOKEN_ENV, "stale")
    code, _, err = _upload(capsys, secured_api, package, "--namespace", "team-a")
    assert code == 2 and "401" in err and f"${kfp_checks.TOKEN_ENV}" in err
    assert secured_api.pipelines == {}


def test_wrong_namespace_gives_a_clear_403_message(secured_api, package, capsys, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    run = ["run", "--host", secured_api.url, "--package", str(package), "--token-file", str(token_file)]
    code, _, err = rtp(capsys, *run, "--namespace", "team-b")
    assert code == 2 and "403" in err and "'team-b'" in err and "--namespace" in err
    code, _, err = rtp(capsys, *run)
    assert code == 2 and "multi-user" in err and "--namespace" in err


def test_a_token_is_never_taken_from_argv_nor_sent_over_plain_http_to_another_host(
    secured_api, package, capsys, monkeypatch
):
    code, _, err = rtp(capsys, "run", "--host", secured_api.url, "--package", str(package), "--token", TOKEN)
    assert code == 2 and "--token is refused" in err and "--token-file" in err
    monkeypatch.setenv(kfp_checks.TOKEN_ENV, TOKEN)
    # 192.0.2.1 (TEST-NET-1) is never contacted: the check happens before any request.
    code, _, err = rtp(capsys, "upload", "--host", "http://192.0.2.1:8888", "--package", str(package))
    assert code == 2 and "plain http" in err and "--insecure" in err
    assert secured_api.pipelines == {}


def test_token_from_file_and_namespace_from_environment_work(
    secured_api, package, capsys, monkeypatch, tmp_path
):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv(kfp_checks.TOKEN_PATH_ENV, str(token_file))
    monkeypatch.setenv(kfp_checks.NAMESPACE_ENV, "team-a")
    assert _upload(capsys, secured_api, package, "--version", "v1")[0] == 0
    code, out, _ = rtp(capsys, "run", "--host", secured_api.url, "--package", str(package), "--version", "v1")
    assert code == 0, out
    [run] = secured_api.runs.values()
    assert secured_api.experiments[run["experiment_id"]]["namespace"] == "team-a"
    [pipeline] = secured_api.pipelines.values()
    assert pipeline["namespace"] == "team-a"


def test_unreachable_host_is_a_clear_message(package, capsys):
    from rtp_support.embedded_s3 import free_port

    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = rtp(capsys, "runs", "--host", url)
    assert code == 2 and f"cannot reach the KFP API at {url}" in err
