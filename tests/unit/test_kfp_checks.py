"""Pure logic of the Kubeflow commands: parameters, cron, intervals, version names, auth, runs table."""

import datetime as dt

import pytest

from rtp_cli import kfp_checks
from rtp_cli.kfp_checks import KfpError

SPEC = {
    "root": {
        "inputDefinitions": {
            "parameters": {
                "steps": {"parameterType": "NUMBER_INTEGER", "defaultValue": 40.0, "description": "d"},
                "max_loss": {"parameterType": "NUMBER_DOUBLE", "defaultValue": 4.0},
                "checkpoint_mode": {"parameterType": "STRING", "defaultValue": "async"},
                "source": {"parameterType": "STRING", "defaultValue": "s3://b/p/"},
                "flag": {"parameterType": "BOOLEAN", "defaultValue": False},
                "tags": {"parameterType": "LIST", "isOptional": True},
            }
        }
    }
}
PARAMETERS = kfp_checks.pipeline_parameters(SPEC)


def test_parameters_are_typed_from_the_spec():
    values = kfp_checks.parse_parameter_arguments(
        [
            "steps=200",
            "max_loss=3.5",
            "checkpoint_mode=sync",
            "source=s3://bkt/y=z",
            "flag=true",
            'tags=["a"]',
        ],
        PARAMETERS,
    )
    assert values == {
        "steps": 200,
        "max_loss": 3.5,
        "checkpoint_mode": "sync",
        "source": "s3://bkt/y=z",  # only the first '=' splits
        "flag": True,
        "tags": ["a"],
    }
    assert type(values["steps"]) is int


@pytest.mark.parametrize(
    ("argument", "needles"),
    [
        ("stepz=3", ["'stepz'", "checkpoint_mode", "max_loss", "steps"]),
        ("steps=2.5", ["steps", "an integer", "NUMBER_INTEGER"]),
        ("steps=many", ["steps", "an integer"]),
        ("max_loss=nan", ["max_loss", "a number"]),
        ("flag=maybe", ["flag", "true or false"]),
        ("tags={}", ["tags", "a JSON list"]),
        ("checkpoint_mode=fast", ["checkpoint_mode", "async", "sync", "off"]),
        ("steps=0", ["steps", "at least 1"]),
        ("steps", ["name=value"]),
        ("=3", ["name=value"]),
    ],
)
def test_bad_parameters_name_the_parameter_and_what_it_takes(argument, needles):
    with pytest.raises(KfpError) as error:
        kfp_checks.parse_parameter_arguments([argument], PARAMETERS)
    for needle in needles:
        assert needle in str(error.value)


def test_a_parameter_given_twice_is_an_error():
    with pytest.raises(KfpError, match="twice"):
        kfp_checks.parse_parameter_arguments(["steps=1", "steps=2"], PARAMETERS)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("0 3 * * *", "0 0 3 * * *"),
        ("*/15 * * * 1-5", "0 */15 * * * 1-5"),
        ("30 2 1,15 JAN-JUN sun", "0 30 2 1,15 JAN-JUN sun"),
        ("0 0 9 ? * 2-6", "0 0 9 ? * 2-6"),  # already KFP's 6-field form
        ("  0   3 * *  * ", "0 0 3 * * *"),
        ("@daily", "@daily"),
    ],
)
def test_cron_becomes_the_six_field_form(given, expected):
    assert kfp_checks.kfp_cron(given) == expected


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        ("0 3 * *", "4 fields"),
        ("0 0 3 * * * *", "7 fields"),
        ("61 * * * *", "minute 61 is outside 0-59"),
        ("0 24 * * *", "hour 24"),
        ("0 3 * * 7", "use 0 for Sunday"),
        ("0 3 32 * *", "day of month 32"),
        ("0 3 * 13 *", "month 13"),
        ("0 3 * FOO *", "month 'FOO' is not a value"),
        ("0 5-3 * * *", "runs backwards"),
        ("*/0 * * * *", "step '0'"),
        ("? * * * *", "'?' is allowed only"),
        ("@every 1h", "--interval"),
    ],
)
def test_bad_cron_is_rejected_with_the_reason(given, needle):
    with pytest.raises(KfpError) as error:
        kfp_checks.kfp_cron(given)
    assert needle in str(error.value)


def test_intervals():
    assert kfp_checks.interval_seconds("90s") == 90
    assert kfp_checks.interval_seconds("6h") == 6 * 3600
    assert kfp_checks.interval_seconds("1h30m") == 5400
    assert kfp_checks.interval_seconds("1d") == 86400
    for bad in ("", "6", "h", "6x", "0s", "1h 30m"):
        with pytest.raises(KfpError):
            kfp_checks.interval_seconds(bad)


def test_max_concurrency_range():
    assert kfp_checks.check_max_concurrency(1) == 1
    for bad in (0, 11):
        with pytest.raises(KfpError, match="1-10"):
            kfp_checks.check_max_concurrency(bad)


def test_default_version_names():
    digest = "ab" * 32
    assert kfp_checks.default_version_name("0.1.0", "1234567abc", False, digest) == "0.1.0-1234567"
    assert kfp_checks.default_version_name("0.1.0", "1234567", True, digest) == "0.1.0-1234567-dirty-abababab"
    assert kfp_checks.default_version_name("0.1.0", "", False, digest) == "0.1.0-abababab"
    description = kfp_checks.version_description("0.1.0", "1234567", digest)
    assert kfp_checks.spec_sha256_in(description) == digest
    assert kfp_checks.spec_sha256_in("uploaded by hand") is None


def _files(mapping):
    return mapping.get


def test_token_comes_from_flag_then_environment_then_file():
    files = _files({kfp_checks.DEFAULT_TOKEN_PATH: "from-file\n", "/elsewhere": "other\n"})
    env = {kfp_checks.TOKEN_ENV: "from-env"}
    assert kfp_checks.resolve_token("/elsewhere", env, files) == ("other", "--token-file /elsewhere")
    with pytest.raises(kfp_checks.KfpError, match="no such file"):
        kfp_checks.resolve_token("/missing", env, files)
    assert kfp_checks.resolve_token(None, env, files) == ("from-env", f"${kfp_checks.TOKEN_ENV}")
    assert kfp_checks.resolve_token(None, {}, files) == ("from-file", kfp_checks.DEFAULT_TOKEN_PATH)
    assert kfp_checks.resolve_token(None, {kfp_checks.TOKEN_PATH_ENV: "/elsewhere"}, files) == (
        "other",
        "/elsewhere",
    )
    assert kfp_checks.resolve_token(None, {}, _files({})) == (None, "no token")


def test_namespace_comes_from_flag_then_environment_then_pod():
    pod = _files({kfp_checks.SERVICE_ACCOUNT_NAMESPACE_PATH: "team-pod\n"})
    assert (
        kfp_checks.resolve_namespace("team-flag", {kfp_checks.NAMESPACE_ENV: "team-env"}, pod) == "team-flag"
    )
    assert kfp_checks.resolve_namespace(None, {kfp_checks.NAMESPACE_ENV: "team-env"}, pod) == "team-env"
    assert kfp_checks.resolve_namespace(None, {}, pod) == "team-pod"
    assert kfp_checks.resolve_namespace(None, {}, _files({})) is None


def test_auth_messages_say_what_to_do():
    unauthenticated = kfp_checks.auth_failure_message(401, "https://kf", "no token", None)
    assert (
        "401" in unauthenticated
        and "--token-file" in unauthenticated
        and kfp_checks.TOKEN_ENV in unauthenticated
    )
    denied = kfp_checks.auth_failure_message(403, "https://kf", "--token-file t", "team-a")
    assert "403" in denied and "'team-a'" in denied and "--namespace" in denied


def test_runs_table_shows_state_duration_and_metrics():
    now = dt.datetime(2026, 1, 2, 12, 0, tzinfo=dt.UTC)
    runs = [
        {
            "run_id": "r1",
            "display_name": "nightly",
            "state": "SUCCEEDED",
            "created_at": "2026-01-02T10:00:00Z",
            "finished_at": "2026-01-02T11:05:30Z",
        },
        {
            "run_id": "r2",
            "display_name": "adhoc",
            "state": "RUNNING",
            "created_at": dt.datetime(2026, 1, 2, 11, 58, 30, tzinfo=dt.UTC),
            "finished_at": "1970-01-01T00:00:00Z",
        },
    ]
    metrics = {
        "r1": kfp_checks.metrics_from_step_records(
            {
                "train": {"final_loss": 2.25},
                "validate": {"holdout_loss": 2.5, "decision": "champion"},
                "register": {"version": "7"},
                "stage_model": {"registry": {"model_name": "rtp-byte-lm", "version": "6"}},
            }
        )
    }
    lines = kfp_checks.format_runs_table(runs, now, metrics).splitlines()
    assert lines[0].split()[:4] == ["run", "state", "created", "duration"]
    assert lines[1].split() == [
        "nightly", "SUCCEEDED", "2026-01-02", "10:00", "1h05m", "2.2500", "2.5000", "champion", "7", "v6", "r1"
    ]  # fmt: skip
    assert lines[2].split()[:5] == ["adhoc", "RUNNING", "2026-01-02", "11:58", "1m30s"]
    assert kfp_checks.format_runs_table([], now) == "no runs"


@pytest.mark.parametrize(
    ("host", "token", "insecure", "refused"),
    [
        ("http://kubeflow.example.com", True, False, True),
        ("http://10.0.0.5:8888", True, False, True),
        ("http://kubeflow.example.com", True, True, False),
        ("http://kubeflow.example.com", False, False, False),
        ("https://kubeflow.example.com", True, False, False),
        ("http://127.0.0.1:8888", True, False, False),
        ("http://localhost:8888", True, False, False),
        ("http://[::1]:8888", True, False, False),
    ],
)
def test_a_token_goes_over_plain_http_only_to_loopback_or_when_told(host, token, insecure, refused):
    if refused:
        with pytest.raises(kfp_checks.KfpError, match="plain http"):
            kfp_checks.check_token_transport(host, token, insecure)
    else:
        kfp_checks.check_token_transport(host, token, insecure)


@pytest.mark.parametrize(
    ("tag_name", "version"),
    [
        ("2.5.0", (2, 5, 0)),
        ("v2.14.3", (2, 14, 3)),
        ("2.5.0-rc.1", (2, 5, 0)),
        (" 2.17.0\n", (2, 17, 0)),
        ("unknown", None),
        ("master", None),
        ("0123456789abcdef", None),
        ("2.5", None),
        ("", None),
        (None, None),
    ],
)
def test_release_version_reads_release_tags_only(tag_name, version):
    assert kfp_checks.release_version(tag_name) == version


def _tag(tag_name):
    return kfp_checks.BackendEvidence(tag_name)


def test_backend_version_refuses_an_older_release():
    with pytest.raises(
        kfp_checks.KfpError,
        match=r"is 2\.4\.1 \(healthz tag_name '2\.4\.1'\) but rtp's pipeline needs 2\.5\.0 or later",
    ):
        kfp_checks.check_backend_version("http://kfp", _tag("2.4.1"))
    with pytest.raises(kfp_checks.KfpError, match=r"is 1\.8\.5 "):
        kfp_checks.check_backend_version("http://kfp", _tag("1.8.5"))


def test_backend_version_accepts_newer_releases():
    assert kfp_checks.check_backend_version("http://kfp", _tag("2.5.0")) is None
    assert kfp_checks.check_backend_version("http://kfp", _tag("v3.0.0"), ["stage-data"]) is None
    assert kfp_checks.check_backend_version("http://kfp", _tag("2.14.0"), ["stage-data"]) is None


def test_unknown_version_warning_says_what_is_unknown():
    warning = kfp_checks.check_backend_version(
        "http://kfp",
        kfp_checks.BackendEvidence("unknown", None, "the Kubernetes API answered 403 Forbidden"),
        ["register-model", "stage-data"],
    )
    assert warning and "\n" not in warning
    assert "cannot tell" in warning and "tag_name 'unknown'" in warning and "2.5.0-2.15.x" in warning
    assert "403 Forbidden" in warning and "needs 2.5.0 or later" in warning
    assert "retries of register-model, stage-data need 2.14.0" in warning


@pytest.mark.parametrize(
    ("image", "version"),
    [
        ("ghcr.io/kubeflow/kfp-api-server:2.5.0", (2, 5, 0)),
        ("gcr.io/ml-pipeline/api-server:2.0.5", (2, 0, 5)),
        ("registry.local:5000/kfp-api-server:2.15.1@sha256:" + "a" * 64, (2, 15, 1)),
        ("registry.local:5000/kfp-api-server", None),
        ("ghcr.io/kubeflow/kfp-api-server@sha256:" + "a" * 64, None),
        ("ghcr.io/kubeflow/kfp-api-server:latest", None),
        (None, None),
    ],
)
def test_image_release_reads_the_tag_only(image, version):
    assert kfp_checks.image_release(image) == version


def test_the_api_server_image_gives_the_version_healthz_hides():
    old = kfp_checks.BackendEvidence("unknown", "ghcr.io/kubeflow/kfp-api-server:2.4.1")
    with pytest.raises(
        kfp_checks.KfpError, match=r"is 2\.4\.1 \(API server image ghcr.io/kubeflow/kfp-api-server:2\.4\.1\)"
    ):
        kfp_checks.check_backend_version("http://kfp", old)
    new = kfp_checks.BackendEvidence("unknown", "ghcr.io/kubeflow/kfp-api-server:2.15.0")
    assert kfp_checks.check_backend_version("http://kfp", new, ["stage-data"]) is None


def test_a_backend_before_2_14_warns_that_it_drops_sub_dag_retries():
    evidence = kfp_checks.BackendEvidence("unknown", "ghcr.io/kubeflow/kfp-api-server:2.5.0")
    warning = kfp_checks.check_backend_version("http://kfp", evidence, ["register-model", "stage-data"])
    assert warning and "\n" not in warning
    assert "is 2.5.0" in warning and "drops the retries of register-model, stage-data" in warning
    assert "2.14.0" in warning and "runs once" in warning
    assert kfp_checks.check_backend_version("http://kfp", evidence, []) is None


def test_retried_sub_dag_tasks_are_found_in_the_compiled_spec():
    spec = {
        "root": {"dag": {"tasks": {"top": {"retryPolicy": {"maxRetryCount": 3}}}}},
        "components": {
            "comp-exit-handler-1": {
                "dag": {"tasks": {"stage": {"retryPolicy": {"maxRetryCount": 3}}, "train": {}}}
            },
            "comp-condition-2": {"dag": {"tasks": {"register": {"retryPolicy": {"maxRetryCount": 3}}}}},
            "comp-train": {"executorLabel": "exec-train"},
        },
    }
    assert kfp_checks.retried_sub_dag_tasks(spec) == ["register", "stage"]
