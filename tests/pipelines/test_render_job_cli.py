"""`rtp render-job` and the Kubernetes flags of `rtp compile`, through the CLI's main()."""

from __future__ import annotations

import pytest
import yaml

from rtp_cli.main import build_parser, main


def test_help_lists_render_job_and_compile_platform_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "render-job" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compile", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--launcher",
        "--fsx-mount-path",
        "--image-pull-policy",
        "--image-pull-secret",
        "--train-pod-gpus",
    ):
        assert flag in out


@pytest.mark.parametrize(("mode", "kind"), [("pytorchjob", "PyTorchJob"), ("trainjob", "TrainJob")])
def test_render_job_prints_the_manifest(capsys, mode, kind):
    argv = ["render-job", "--mode", mode, "--run-id", "r-42", "--nnodes", "3", "--gpus-per-node", "4",
            "--nproc-per-node", "4", "--node-selector", '{"pool": "gpu"}']  # fmt: skip
    assert main(argv) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    assert manifest["kind"] == kind
    assert manifest["metadata"]["name"] == "rtp-train-r-42"
    assert "--nnodes=3:3" in yaml.safe_dump(manifest)


@pytest.mark.parametrize(
    ("extra", "secret"), [([], "mlflow-credentials"), (["--mlflow-secret-name", "team-ml"], "team-ml")]
)
def test_render_job_pods_read_mlflow_from_the_named_secret(capsys, extra, secret):
    assert main(["render-job", "--mode", "pytorchjob", *extra]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    env = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    refs = {item["name"]: item["valueFrom"]["secretKeyRef"] for item in env if "valueFrom" in item}
    assert set(refs) == {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
    assert {ref["name"] for ref in refs.values()} == {secret}


def test_render_job_without_an_mlflow_secret_and_its_help(capsys):
    assert main(["render-job", "--mode", "trainjob", "--mlflow-secret-name", ""]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    assert not any(item["name"].startswith("MLFLOW_") for item in manifest["spec"]["trainer"]["env"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["render-job", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--mlflow-secret-name" in help_text and "password -> MLFLOW_TRACKING_PASSWORD" in help_text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nnodes", "0"], "nnodes must be at least 1"),
        (["--gpus-per-node", "2", "--nproc-per-node", "4"], "one process per GPU"),
        (["--node-selector", "pool=gpu"], "--node-selector is not valid JSON"),
        (["--tolerations", "{}"], "--tolerations must be a JSON list"),
        (["--overrides", "model.n_heads=3"], "divisible"),
        (["--mlflow-secret-name", "MLflow_Creds"], "must be a Kubernetes secret name"),
    ],
)
def test_render_job_bad_input_is_one_line_and_exit_2(capsys, extra, message):
    assert main(["render-job", "--mode", "pytorchjob", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_compile_flags_reach_the_compiled_pipeline(tmp_path, capsys):
    target = tmp_path / "p.yaml"
    argv = ["compile", "-o", str(target), "--launcher", "trainjob", "--fsx-mount-path", "/lustre",
            "--image-pull-secret", "regcred"]  # fmt: skip
    assert main(argv) == 0
    pipeline, platform_spec = [doc for doc in yaml.safe_load_all(target.read_text()) if doc]
    parameters = pipeline["root"]["inputDefinitions"]["parameters"]
    assert parameters["launcher"]["defaultValue"] == "trainjob"
    train = platform_spec["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train-model"]
    assert train["pvcMount"][0]["mountPath"] == "/lustre"
    assert [secret["secretName"] for secret in train["imagePullSecret"]] == ["regcred"]
    assert "launcher trainjob" in capsys.readouterr().out


def test_a_watcher_pod_that_would_hold_gpus_is_refused(tmp_path, capsys):
    """With a job launcher the train step's pod only watches the job: GPUs there are a whole
    p5 taken from the job (issue 18); in-pod training may still ask for them."""
    argv = ["compile", "-o", str(tmp_path / "p.yaml"), "--launcher", "pytorchjob", "--train-pod-gpus", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "compile without --train-pod-gpus" in err and "Traceback" not in err
    assert (
        main(["compile", "-o", str(tmp_path / "q.yaml"), "--launcher", "inpod", "--train-pod-gpus", "8"]) == 0
    )


def test_compile_refuses_a_relative_mount_path(tmp_path, capsys):
    assert main(["compile", "-o", str(tmp_path / "p.yaml"), "--fsx-mount-path", "fsx"]) == 2
    assert "must be absolute" in capsys.readouterr().err
