"""The training-job launcher's create/watch/log/timeout/delete logic, against a FAKE API server.

No real Kubernetes cluster can run on the development machines, so these tests run the
launcher (the real `kubernetes` client, version 30.1.0) against `tests.fakes.kube_api`: a
stateful stand-in on 127.0.0.1 that validates every created job strictly against the
upstream CRD schemas in tests/specs/crds and simulates the job's phases, its rank-0
pod's log and failures; one test runs a rendered pod's command for real, as a kubelet
would, against a real MLflow server. What the fake cannot show (scheduling, real
operators, EFA) is covered only by the manifests' schema checks and by docs/eks.md.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
from kubernetes import client

from components.train.job_train import train_with_job
from components.train.jobs import RUN_ID_LABEL, JobSettings, job_manifest
from components.train.k8s_launcher import (
    JobFailed,
    JobTimedOut,
    PodStuck,
    StatusUnknown,
    delete_run_jobs,
    run_job,
)
from components.train.train import (
    CheckpointOutsideRun,
    TrainingIncomplete,
    TrainRequest,
    TrainResult,
    checked_result,
)
from tests.fakes.kube_api import FakeKubernetes, PodTrouble, Scenario
from trainer.config import TrainConfig
from trainer.summary import TrainSummary

RUN_ID = "5e1f7a10-0c4b-4c1e-9d7e-0123456789ab"


@pytest.fixture
def fake(upstream_specs: Path):
    with FakeKubernetes(upstream_specs / "crds") as server:
        yield server


def api_client(fake: FakeKubernetes) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = fake.url
    return client.ApiClient(configuration)


def settings(name: str = "rtp-train-test", **fields) -> JobSettings:
    defaults = dict(
        namespace="team-a", image="example.com/rtp:1", trainer_args=["--steps=4"], run_id=RUN_ID,
        nnodes=2, nproc_per_node=1,
    )  # fmt: skip
    return JobSettings(name=name, **{**defaults, **fields})


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_success_streams_rank0_log_once_and_keeps_the_job(fake, launcher):
    fake.default_scenario = Scenario(log_lines=["step 1 loss 5.1", "step 2 loss 4.9", "saved step 2"])
    lines: list[str] = []
    job = run_job(
        job_manifest(launcher, settings()), api_client=api_client(fake), timeout_s=30,
        poll_interval_s=0.01, write=lines.append,
    )  # fmt: skip
    assert job["metadata"]["name"] == "rtp-train-test"
    log_lines = [line for line in lines if line.startswith(("step", "saved"))]
    assert log_lines == ["step 1 loss 5.1", "step 2 loss 4.9", "saved step 2"]
    assert any("(rank 0)" in line for line in lines)
    assert fake.deleted == []


def test_failure_raises_with_the_engines_message_and_deletes_the_job(fake):
    fake.default_scenario = Scenario(outcome="fail", failure_message="pod rtp-train-test-worker-0 OOMKilled")
    with pytest.raises(JobFailed, match="OOMKilled"):
        run_job(job_manifest("pytorchjob", settings()), api_client=api_client(fake), timeout_s=30,
                poll_interval_s=0.01, write=lambda line: None)  # fmt: skip
    assert fake.deleted == ["rtp-train-test"]


def test_timeout_deletes_the_job(fake):
    fake.default_scenario = Scenario(outcome="hang")
    with pytest.raises(JobTimedOut, match="job_timeout_s"):
        run_job(job_manifest("trainjob", settings()), api_client=api_client(fake), timeout_s=0.3,
                poll_interval_s=0.02, write=lambda line: None)  # fmt: skip
    assert fake.deleted == ["rtp-train-test"]
    assert fake.jobs == {}


def test_sigterm_while_watching_deletes_the_job(fake):
    fake.default_scenario = Scenario(outcome="hang")
    timer = threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGTERM))
    previous = signal.getsignal(signal.SIGTERM)
    timer.start()
    try:
        with pytest.raises(JobFailed, match="terminated"):
            run_job(job_manifest("pytorchjob", settings()), api_client=api_client(fake), timeout_s=20,
                    poll_interval_s=0.02, write=lambda line: None)  # fmt: skip
    finally:
        timer.join()
    assert fake.deleted == ["rtp-train-test"]
    assert signal.getsignal(signal.SIGTERM) == previous


def test_sigterm_inside_any_code_of_the_step_interrupts_nothing_and_still_deletes_the_job(fake):
    """The handler runs wherever the main thread is: here inside a lock taken without `with`
    (as logging takes its module lock). It only notes the signal; the watch loop ends at its
    next wait, so the lock is released and the job is still deleted."""
    fake.default_scenario = Scenario(outcome="hang", log_lines=["step 1 loss 5.1"])
    lock = threading.Lock()

    def write(line: str) -> None:
        if line.startswith("step 1"):
            lock.acquire()
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # SIGTERM arrives here
            lock.release()

    with pytest.raises(JobFailed, match="terminated"):
        run_job(job_manifest("pytorchjob", settings()), api_client=api_client(fake), timeout_s=20,
                poll_interval_s=0.02, write=write)  # fmt: skip
    assert not lock.locked()
    assert fake.deleted == ["rtp-train-test"]


def test_a_manifest_the_schema_rejects_fails_with_the_servers_reason(fake):
    manifest = job_manifest("pytorchjob", settings())
    manifest["spec"]["runPolicy"]["restartEverything"] = True
    with pytest.raises(JobFailed, match="restartEverything"):
        run_job(
            manifest, api_client=api_client(fake), timeout_s=5, poll_interval_s=0.01, write=lambda line: None
        )
    assert fake.jobs == {}
    assert len(fake.rejected) == 1


def test_missing_operator_is_named(upstream_specs):
    with (
        FakeKubernetes(upstream_specs / "crds", kinds=("PyTorchJob",)) as fake,
        pytest.raises(JobFailed, match="install the Kubeflow Trainer v2"),
    ):
        run_job(job_manifest("trainjob", settings()), api_client=api_client(fake), timeout_s=5,
                poll_interval_s=0.01, write=lambda line: None)  # fmt: skip


def test_retry_replaces_a_finished_job_of_the_same_run(fake):
    fake.scenarios["rtp-train-test"] = Scenario(outcome="fail")
    api = api_client(fake)
    manifest = job_manifest("pytorchjob", settings())
    custom = client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object("kubeflow.org", "v1", "team-a", "pytorchjobs", manifest)
    for _ in range(3):  # the earlier attempt's job runs to Failed
        custom.get_namespaced_custom_object("kubeflow.org", "v1", "team-a", "pytorchjobs", "rtp-train-test")
    fake.scenarios["rtp-train-test"] = Scenario(outcome="succeed")
    run_job(manifest, api_client=api, timeout_s=10, poll_interval_s=0.01, write=lambda line: None)
    assert fake.deleted == ["rtp-train-test"]
    assert "rtp-train-test" in {name for (_, _, name) in fake.jobs}


def test_cleanup_deletes_only_this_runs_jobs(fake):
    api = api_client(fake)
    custom = client.CustomObjectsApi(api)
    mine = [job_manifest("pytorchjob", settings("mine-a")), job_manifest("trainjob", settings("mine-b"))]
    other = job_manifest("pytorchjob", settings("other", run_id="another-run"))
    # Applied by hand from `rtp render-job` with the same run id: not rtp's to delete.
    by_hand = job_manifest("pytorchjob", settings("by-hand", managed_by="rtp-render-job"))
    for manifest in [*mine, other, by_hand]:
        group, version = manifest["apiVersion"].split("/")
        plural = "pytorchjobs" if manifest["kind"] == "PyTorchJob" else "trainjobs"
        custom.create_namespaced_custom_object(group, version, "team-a", plural, manifest)
    assert other["metadata"]["labels"][RUN_ID_LABEL] == "another-run"
    assert sorted(delete_run_jobs(api, "team-a", RUN_ID)) == ["PyTorchJob/mine-a", "TrainJob/mine-b"]
    assert sorted(fake.deleted) == ["mine-a", "mine-b"]
    assert delete_run_jobs(api, "team-a", RUN_ID) == []
    with pytest.raises(JobFailed, match="no run id"):
        delete_run_jobs(api, "team-a", "")


def test_transient_status_errors_are_retried_and_the_job_survives(fake):
    fake.failing_reads = [503, 500, 429, 503]
    job = run_job(
        job_manifest("pytorchjob", settings()), api_client=api_client(fake), timeout_s=30,
        poll_interval_s=0.01, write=lambda line: None,
    )  # fmt: skip
    assert job["metadata"]["name"] == "rtp-train-test" and fake.failing_reads == []
    assert fake.deleted == []


def test_a_status_that_stays_unreadable_fails_the_step_but_keeps_the_job(fake):
    fake.default_scenario = Scenario(outcome="hang")
    fake.failing_reads = [503] * 10_000
    with pytest.raises(StatusUnknown, match="left running"):
        run_job(
            job_manifest("pytorchjob", settings()), api_client=api_client(fake), timeout_s=30,
            poll_interval_s=0.01, write=lambda line: None, status_read_grace_s=0.3,
        )  # fmt: skip
    assert fake.deleted == []


def fake_summary(steps: int, checkpoint: str) -> TrainSummary:
    return TrainSummary(
        steps=steps, target_steps=steps, completed=True, stopped_by_signal=False, steps_run=steps,
        final_loss=4.2, losses=[{"step": steps, "loss": 4.2}], checkpoint=checkpoint, checkpoint_mode="async",
        resumed_from=None, checkpoint_saves=[], checkpoint_blocked_s=0.0, efficiency_pct=100.0,
        final_drain_s=0.0, checkpointer_start_s=0.0, checkpointer_teardown_s=0.0, loop_wall_s=1.5,
        world_size=4, device="cpu", model_sha256="ab" * 32, train_seconds=1.5, wall_seconds=2.0,
    )  # fmt: skip


def mlflow_env(job_spec: dict) -> dict[str, dict]:
    """The MLflow variables of a created job's training containers, by name: the secret
    reference each one reads (a value would put a credential into the job object)."""
    if "pytorchReplicaSpecs" in job_spec:
        envs = [
            r["template"]["spec"]["containers"][0]["env"] for r in job_spec["pytorchReplicaSpecs"].values()
        ]
    else:
        envs = [job_spec["trainer"]["env"]]
    found = [{item["name"]: item for item in env if item["name"].startswith("MLFLOW_")} for env in envs]
    assert all(entries == found[0] for entries in found)  # master and workers alike
    assert all(set(item) == {"name", "valueFrom"} for item in found[0].values())
    return {name: item["valueFrom"]["secretKeyRef"] for name, item in found[0].items()}


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_train_with_job_returns_the_summary_rank0_wrote(fake, tmp_path, launcher):
    run_folder = tmp_path / "fsx" / "rtp" / "runs" / "r1"
    (run_folder / "train").mkdir(parents=True)
    (run_folder / "train" / "summary.json").write_text('{"stale": true}')
    written = fake_summary(steps=4, checkpoint=str(run_folder / "checkpoints" / "step_4"))

    def rank0_writes_summary(job: dict) -> None:
        # Stands in for global rank 0 writing onto the shared volume at the end of training.
        args = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"] if (
            job["kind"] == "PyTorchJob") else job["spec"]["trainer"]["command"]  # fmt: skip
        [inline] = [arg.removeprefix("--config=") for arg in args if arg.startswith("--config=")]
        assert args[:3] == ["python", "-m", "trainer.health"]  # the node is checked first
        launched = args[args.index("--") + 1 :]
        assert launched[0] == "ft_launcher"
        assert launched[launched.index("-m") + 1] == "rtp_prefork"  # restarted ranks are forked pre-imported
        pods_config = TrainConfig.from_json(inline)
        assert pods_config.run.workdir == str(run_folder / "train") and pods_config.run.steps == 4
        assert TrainConfig.read(run_folder / "train" / "config.json") == pods_config  # the run's record
        written.write(run_folder / "train" / "summary.json")

    fake.on_success = rank0_writes_summary
    request = TrainRequest(
        dataset_dir=str(tmp_path / "data"), run_folder=run_folder, preset="tiny-cpu",
        settings={"steps": 4, "checkpoint_every": 2, "seed": 1},
    )  # fmt: skip
    result = train_with_job(
        launcher, request, run_id=RUN_ID, namespace="team-a", image="example.com/rtp:1", nproc_per_node=2,
        timeout_s=30, poll_interval_s=0.01, api_client=api_client(fake), nnodes=2, pvc_name="fsx-claim",
        mount_path=str(tmp_path / "fsx"), mlflow_secret_name="team-mlflow",
    )  # fmt: skip
    assert result.summary == written
    created = fake.jobs[next(iter(fake.jobs))].body["spec"]
    assert mlflow_env(created) == {
        "MLFLOW_TRACKING_URI": {"name": "team-mlflow", "key": "tracking_uri", "optional": False},
        "MLFLOW_TRACKING_USERNAME": {"name": "team-mlflow", "key": "username", "optional": False},
        "MLFLOW_TRACKING_PASSWORD": {"name": "team-mlflow", "key": "password", "optional": False},
    }
    deadline = (
        created["runPolicy"]["activeDeadlineSeconds"]
        if launcher == "pytorchjob"
        else created["activeDeadlineSeconds"]
    )
    assert deadline == 30 + 600
    assert result.launcher == launcher and result.job_name.startswith("rtp-train-5e1f7a10")
    assert result.model_config["n_layers"] >= 1 and result.config.checkpoint.every_steps == 2


def test_a_checkpoint_outside_the_run_folder_is_refused(fake, tmp_path):
    run_folder = tmp_path / "fsx" / "rtp" / "runs" / "r1"
    (run_folder / "train").mkdir(parents=True)
    elsewhere = str(tmp_path / "fsx" / "rtp" / "runs" / "nightly" / "checkpoints" / "step_4")

    def rank0_reports_another_runs_checkpoint(job: dict) -> None:
        fake_summary(steps=4, checkpoint=elsewhere).write(run_folder / "train" / "summary.json")

    fake.on_success = rank0_reports_another_runs_checkpoint
    with pytest.raises(CheckpointOutsideRun, match="not under this run"):
        train_with_job(
            "pytorchjob", TrainRequest(dataset_dir="/fsx/d", run_folder=run_folder), run_id=RUN_ID,
            namespace="team-a", image="example.com/rtp:1", nproc_per_node=1, timeout_s=30, poll_interval_s=0.01,
            api_client=api_client(fake), pvc_name="fsx-claim", mount_path=str(tmp_path / "fsx"),
        )  # fmt: skip


def test_train_with_job_without_a_summary_names_the_volume(fake, tmp_path):
    with pytest.raises(JobFailed, match=r"wrote no .*summary\.json.*fsx-claim"):
        train_with_job(
            "pytorchjob", TrainRequest(dataset_dir="/fsx/d", run_folder=tmp_path / "run"), run_id=RUN_ID,
            namespace="team-a", image="example.com/rtp:1", nproc_per_node=1, timeout_s=30, poll_interval_s=0.01,
            api_client=api_client(fake), pvc_name="fsx-claim",
        )  # fmt: skip


def test_a_job_deleted_by_someone_else_ends_the_watch_without_a_delete(fake, monkeypatch):
    from components.train import k8s_launcher

    fake.default_scenario = Scenario(outcome="hang", log_lines=["step 1 loss 5.1"])
    deletes: list[str] = []
    monkeypatch.setattr(k8s_launcher, "delete_job", lambda api, ref: deletes.append(ref.name))

    def write(line: str) -> None:
        if line.startswith("step 1"):
            with fake._lock:
                fake.jobs.clear()  # kubectl delete, meanwhile

    with pytest.raises(k8s_launcher.JobGone, match="was deleted while it ran"):
        run_job(job_manifest("pytorchjob", settings()), api_client=api_client(fake), timeout_s=20,
                poll_interval_s=0.01, write=write)  # fmt: skip
    assert deletes == []


def test_a_status_read_the_step_may_not_make_deletes_the_job(fake):
    fake.default_scenario = Scenario(outcome="hang")
    fake.failing_reads = [403]  # not transient: no point in waiting for it to pass
    with pytest.raises(JobFailed, match="could not read"):
        run_job(job_manifest("pytorchjob", settings()), api_client=api_client(fake), timeout_s=20,
                poll_interval_s=0.01, write=lambda line: None)  # fmt: skip
    assert fake.deleted == ["rtp-train-test"]


@pytest.mark.parametrize(
    ("launcher", "state", "deleted"),
    [
        ("pytorchjob", "FAILED", ["rtp-train-test"]),
        ("trainjob", "CANCELED", ["rtp-train-test"]),
        ("pytorchjob", "SUCCEEDED", []),
        ("inpod", "FAILED", []),
    ],
)
def test_exit_handler_deletes_the_job_only_when_the_run_did_not_succeed(fake, launcher, state, deleted):
    from components.cleanup_jobs.cleanup import cleanup_after_run

    kind = launcher if launcher != "inpod" else "pytorchjob"
    manifest = job_manifest(kind, settings())
    group, version = manifest["apiVersion"].split("/")
    plural = "pytorchjobs" if manifest["kind"] == "PyTorchJob" else "trainjobs"
    api = api_client(fake)
    client.CustomObjectsApi(api).create_namespaced_custom_object(group, version, "team-a", plural, manifest)
    cleanup_after_run(launcher, state, RUN_ID, "team-a", api_client=api)
    assert fake.deleted == deleted


def stuck_job(fake: FakeKubernetes, launcher: str, troubles: dict, **run_args) -> JobFailed:
    fake.default_scenario = Scenario(outcome="hang", pod_troubles=troubles)
    lines: list[str] = []
    with pytest.raises(JobFailed) as raised:
        run_job(
            job_manifest(launcher, settings()), api_client=api_client(fake), timeout_s=20,
            poll_interval_s=0.01, write=lines.append, **run_args,
        )  # fmt: skip
    return raised.value


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_a_master_pod_that_stays_pending_fails_fast_with_the_schedulers_reason(fake, launcher):
    error = stuck_job(fake, launcher, {0: PodTrouble("unschedulable", since_s=1000)}, pending_timeout_s=900)
    assert isinstance(error, PodStuck)
    assert "could not be scheduled" in str(error) and "Insufficient nvidia.com/gpu" in str(error)
    assert fake.deleted == ["rtp-train-test"]  # no pod keeps waiting on GPU nodes


def test_a_pending_pod_gets_its_grace_while_a_node_group_may_scale_up(fake):
    fake.default_scenario = Scenario(
        outcome="hang", pod_troubles={0: PodTrouble("unschedulable", since_s=10)}
    )
    with pytest.raises(JobTimedOut):  # only the step's own timeout ends it: still within pending_timeout_s
        run_job(job_manifest("pytorchjob", settings()), api_client=api_client(fake), timeout_s=0.3,
                poll_interval_s=0.01, write=lambda line: None, pending_timeout_s=900)  # fmt: skip


def test_a_pod_no_node_group_can_take_fails_at_once(fake):
    error = stuck_job(fake, "pytorchjob", {1: PodTrouble("no-scale-up")}, pending_timeout_s=900)
    assert "rtp-train-test-worker-0" in str(error) and "max node group size" in str(error)


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_an_image_pull_backoff_fails_fast_with_the_image(fake, launcher):
    error = stuck_job(fake, launcher, {1: PodTrouble("image-pull")})
    assert isinstance(error, PodStuck)
    assert "ImagePullBackOff" in str(error) and "example.com/rtp:1" in str(error)
    assert fake.deleted == ["rtp-train-test"]


def test_a_crash_loop_past_the_jobs_backoff_limit_fails_with_the_exit_code(fake):
    error = stuck_job(fake, "pytorchjob", {0: PodTrouble("crash-loop", restarts=5)})
    assert "CrashLoopBackOff after 5 restarts" in str(error) and "exit code 1" in str(error)
    assert "kubectl logs rtp-train-test-master-0" in str(error)


def test_a_crash_loop_within_the_backoff_limit_is_left_to_the_engine(fake):
    fake.default_scenario = Scenario(outcome="hang", pod_troubles={0: PodTrouble("crash-loop", restarts=1)})
    with pytest.raises(JobTimedOut):
        run_job(job_manifest("pytorchjob", settings(backoff_limit=3)), api_client=api_client(fake),
                timeout_s=0.3, poll_interval_s=0.01, write=lambda line: None)  # fmt: skip


def test_a_worker_whose_init_container_waits_too_long_fails(fake):
    error = stuck_job(fake, "pytorchjob", {1: PodTrouble("init-wait", since_s=1200)}, pending_timeout_s=900)
    assert "init container init-pytorch of pod rtp-train-test-worker-0" in str(error)
    assert "master pod" in str(error)


def test_without_events_permission_the_pods_status_still_names_the_reason(fake):
    fake.events_forbidden = True
    error = stuck_job(
        fake, "pytorchjob", {0: PodTrouble("unschedulable", since_s=1000)}, pending_timeout_s=900
    )
    assert "Insufficient nvidia.com/gpu" in str(error)


def test_a_run_stopped_by_sigterm_before_its_last_step_is_not_a_success(fake, tmp_path):
    """A drained node's SIGTERM: every rank saved and the engine may report Succeeded, but the
    summary says the target was not reached. The step fails (so validate and register never
    run: they take the train step's output) and names the checkpoint a rerun resumes from."""
    run_folder = tmp_path / "fsx" / "rtp" / "runs" / "r1"
    (run_folder / "train").mkdir(parents=True)
    checkpoint = str(run_folder / "checkpoints" / "step_60")
    partial = fake_summary(steps=60, checkpoint=checkpoint)
    partial.target_steps, partial.completed, partial.stopped_by_signal = 100, False, True
    fake.on_success = lambda job: partial.write(run_folder / "train" / "summary.json")
    with pytest.raises(TrainingIncomplete, match=r"step 60 of 100: it was stopped by SIGTERM.*step_60"):
        train_with_job(
            "pytorchjob", TrainRequest(dataset_dir="/fsx/d", run_folder=run_folder, settings={"steps": 100}),
            run_id=RUN_ID, namespace="team-a", image="example.com/rtp:1", nproc_per_node=1, timeout_s=30,
            poll_interval_s=0.01, api_client=api_client(fake), pvc_name="fsx-claim",
            mount_path=str(tmp_path / "fsx"),
        )  # fmt: skip


def test_the_in_pod_path_refuses_an_incomplete_summary_too(tmp_path):
    config = TrainRequest(dataset_dir="/fsx/d", run_folder=tmp_path, settings={"steps": 100}).config()
    partial = fake_summary(steps=60, checkpoint=str(tmp_path / "checkpoints" / "step_60"))
    partial.target_steps, partial.completed, partial.stopped_by_signal = 100, False, True
    request = TrainRequest(dataset_dir="/fsx/d", run_folder=tmp_path)
    with pytest.raises(TrainingIncomplete):
        checked_result(TrainResult(summary=partial, config=config, preset="tiny-cpu"), request)
    done = fake_summary(steps=100, checkpoint=str(tmp_path / "checkpoints" / "step_100"))
    assert (
        checked_result(TrainResult(summary=done, config=config, preset="tiny-cpu"), request).summary == done
    )


def test_a_gpu_job_trains_with_gpu_scale_timeouts_and_a_cpu_job_with_the_trainers(fake, tmp_path):
    from components.train.job_scale import GPU_SCALE

    run_folder = tmp_path / "fsx" / "rtp" / "runs" / "r1"
    (run_folder / "train").mkdir(parents=True)
    for gpus, soft in ((0, TrainConfig().resilience.soft_timeout_s), (8, GPU_SCALE.soft_timeout_s)):
        fake.on_success = lambda job: fake_summary(4, str(run_folder / "checkpoints" / "step_4")).write(
            run_folder / "train" / "summary.json"
        )
        result = train_with_job(
            "pytorchjob", TrainRequest(dataset_dir="/fsx/d", run_folder=run_folder, settings={"steps": 4}),
            run_id=f"{RUN_ID[:-1]}{gpus}", namespace="team-a", image="example.com/rtp:1",
            nproc_per_node=1, timeout_s=30, poll_interval_s=0.01, api_client=api_client(fake),
            pvc_name="fsx-claim", mount_path=str(tmp_path / "fsx"), gpus_per_node=gpus,
        )  # fmt: skip
        assert result.config.resilience.soft_timeout_s == soft
        assert TrainConfig.read(run_folder / "train" / "config.json").resilience.soft_timeout_s == soft


def test_the_train_step_reports_no_model_when_a_job_stopped_on_sigterm_early(fake, tmp_path, monkeypatch):
    """The train component itself, with the job launcher against the fake API: the engine
    says Succeeded, rank 0's summary says SIGTERM stopped it at step 60 of 100. The step
    raises, so KFP marks it failed and never starts validate or register (they consume its
    `model` output), and it records no model, metrics or step record for anyone to pick up."""
    from types import SimpleNamespace

    import components.train.job_train as job_train
    from components.train.component import train_model

    mount = tmp_path / "fsx"
    run_folder = mount / "rtp" / "runs" / "drained"
    (run_folder / "train").mkdir(parents=True)
    partial = fake_summary(steps=60, checkpoint=str(run_folder / "checkpoints" / "step_60"))
    partial.target_steps, partial.completed, partial.stopped_by_signal = 100, False, True
    fake.on_success = lambda job: partial.write(run_folder / "train" / "summary.json")
    monkeypatch.setattr(job_train, "in_cluster_api_client", lambda: api_client(fake))
    monkeypatch.setattr(
        job_train, "run_job", lambda manifest, **kw: run_job(manifest, **{**kw, "poll_interval_s": 0.01})
    )
    model = SimpleNamespace(metadata={}, path=str(tmp_path / "model.json"))
    logged: list[tuple[str, float]] = []
    metrics = SimpleNamespace(log_metric=lambda name, value: logged.append((name, value)))
    with pytest.raises(TrainingIncomplete, match="step 60 of 100"):
        train_model(
            dataset=SimpleNamespace(metadata={"snapshot_dir": str(mount / "d")}),
            base_model=SimpleNamespace(metadata={}), fsx_mount_path=str(mount), run_name="drained",
            run_id=RUN_ID, steps=100, nproc=1, checkpoint_every=10, checkpoint_mode="async", seed=1,
            preset="tiny-cpu", overrides="", faults="none", model_init="pretrained", model=model,
            metrics=metrics, goodput_report=SimpleNamespace(path=str(tmp_path / "report.html")),
            launcher="pytorchjob", nnodes=2, job_image="example.com/rtp:1", job_namespace="team-a",
            mlflow_secret_name="team-mlflow",
        )  # fmt: skip
    assert model.metadata == {} and not (tmp_path / "model.json").exists() and logged == []
    assert not (run_folder / "steps" / "train.json").exists()
    # The component hands its secret name to the job: rank 0 there logs the live metrics.
    created = fake.jobs[next(iter(fake.jobs))].body["spec"]
    assert {ref["name"] for ref in mlflow_env(created).values()} == {"team-mlflow"}


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_a_volume_that_does_not_mount_fails_with_the_pvc_and_what_to_check(fake, launcher):
    """FailedMount events for longer than the kubelet's retries may need: the step fails in one
    line naming the PVC, the kubelet's reason and the FSx checks, and deletes the job."""
    error = stuck_job(fake, launcher, {1: PodTrouble("mount-fail", since_s=400)}, pending_timeout_s=900)
    assert isinstance(error, PodStuck)
    message = str(error)
    assert "cannot mount PVC fsx-claim" in message and "MountVolume.SetUp failed" in message
    assert "988 and 1018-1023" in message and "Bound" in message and "CSI" in message
    assert "\n" not in message
    assert fake.deleted == ["rtp-train-test"]  # no pod keeps holding a GPU node


def test_a_mount_failure_gets_the_kubelets_retries_first(fake):
    fake.default_scenario = Scenario(outcome="hang", pod_troubles={0: PodTrouble("mount-fail", since_s=30)})
    with pytest.raises(JobTimedOut):  # a CSI node plugin may still be registering on a new node
        run_job(job_manifest("pytorchjob", settings()), api_client=api_client(fake), timeout_s=0.3,
                poll_interval_s=0.01, write=lambda line: None, pending_timeout_s=900)  # fmt: skip


def test_a_pod_that_stays_in_container_creating_fails_even_without_events(fake):
    fake.events_forbidden = True
    error = stuck_job(fake, "trainjob", {0: PodTrouble("creating", since_s=1000)}, pending_timeout_s=900)
    assert "still creating its containers" in str(error) and "PVC fsx-claim" in str(error)
    assert fake.deleted == ["rtp-train-test"]


def test_a_missing_mlflow_secret_in_the_jobs_namespace_fails_at_once_naming_it(fake):
    error = stuck_job(fake, "pytorchjob", {0: PodTrouble("missing-secret")})
    assert 'CreateContainerConfigError: secret "mlflow-credentials" not found' in str(error)
    assert "mlflow_secret_name" in str(error)


@pytest.mark.parametrize(
    "trouble", ["mount-fail", "creating", "missing-secret", "unschedulable", "init-wait", "unhealthy-node"]
)
def test_the_fakes_pods_and_events_are_valid_core_objects(fake, trouble):
    """The fake's pods and events must be what the API server could send: every field is one
    of the client's V1Pod / CoreV1Event models (generated from the Kubernetes OpenAPI spec)."""
    from tests.fakes.k8s_models import unknown_fields

    fake.default_scenario = Scenario(outcome="hang", pod_troubles={1: PodTrouble(trouble, since_s=10)})
    custom, core = client.CustomObjectsApi(api_client(fake)), client.CoreV1Api(api_client(fake))
    manifest = job_manifest("pytorchjob", settings())
    custom.create_namespaced_custom_object("kubeflow.org", "v1", "team-a", "pytorchjobs", manifest)
    custom.get_namespaced_custom_object("kubeflow.org", "v1", "team-a", "pytorchjobs", "rtp-train-test")
    pods = core.list_namespaced_pod("team-a").items
    assert len(pods) == 2
    for pod in pods:
        raw = core.api_client.sanitize_for_serialization(pod)
        assert unknown_fields(raw, "V1Pod") == []
        events = core.list_namespaced_event(
            "team-a", field_selector=f"involvedObject.name={pod.metadata.name}"
        )
        for event in events.items:
            assert unknown_fields(core.api_client.sanitize_for_serialization(event), "CoreV1Event") == []
    assert pods[1].spec.volumes[0].persistent_volume_claim.claim_name == "fsx-claim"


def test_a_trainjob_crash_loop_is_allowed_the_gpu_tables_restarts_like_a_pytorchjob(fake):
    """A TrainJob has no backoffLimit: the watcher allows job_scale's, 10 restarts on GPUs."""
    from components.train.job_scale import GPU_SCALE

    assert GPU_SCALE.backoff_limit > 5
    fake.default_scenario = Scenario(outcome="hang", pod_troubles={0: PodTrouble("crash-loop", restarts=5)})
    with pytest.raises(JobTimedOut):
        run_job(job_manifest("trainjob", settings(gpus_per_node=8)), api_client=api_client(fake),
                timeout_s=0.3, poll_interval_s=0.01, write=lambda line: None)  # fmt: skip
    error = stuck_job(fake, "trainjob", {0: PodTrouble("crash-loop", restarts=5)})  # CPU: 2 allowed
    assert "CrashLoopBackOff after 5 restarts (the job allows 2)" in str(error)


def test_train_with_job_passes_a_users_backoff_limit_to_the_trainjob_watcher(fake, tmp_path):
    fake.default_scenario = Scenario(outcome="hang", pod_troubles={0: PodTrouble("crash-loop", restarts=4)})
    with pytest.raises(PodStuck, match=r"after 4 restarts \(the job allows 3\)"):
        train_with_job(
            "trainjob", TrainRequest(dataset_dir="/fsx/d", run_folder=tmp_path / "run"), run_id=RUN_ID,
            namespace="team-a", image="example.com/rtp:1", nproc_per_node=1, timeout_s=30, poll_interval_s=0.01,
            api_client=api_client(fake), pvc_name="fsx-claim", backoff_limit=3,
        )  # fmt: skip


def in_pod(monkeypatch, name: str, namespace: str, uid: str = "") -> None:
    """The downward-API environment the compiled pipeline gives the train step's container."""
    monkeypatch.setenv("POD_NAME", name)
    monkeypatch.setenv("POD_NAMESPACE", namespace)
    if uid:
        monkeypatch.setenv("POD_UID", uid)
    else:
        monkeypatch.delenv("POD_UID", raising=False)
        monkeypatch.delenv("KFP_POD_UID", raising=False)


def train_until_created(fake: FakeKubernetes, tmp_path: Path, launcher: str = "pytorchjob", **fields) -> None:
    fake.default_scenario = Scenario(outcome="hang")
    with pytest.raises(JobTimedOut):
        train_with_job(
            launcher, TrainRequest(dataset_dir="/fsx/d", run_folder=tmp_path / "run"), run_id=RUN_ID,
            namespace="team-a", image="example.com/rtp:1", nproc_per_node=1, timeout_s=0.2, poll_interval_s=0.01,
            api_client=api_client(fake), pvc_name="fsx-claim", **fields,
        )  # fmt: skip


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_the_job_is_owned_by_the_train_steps_pod_read_from_the_api(fake, tmp_path, monkeypatch, launcher):
    """KFP Terminate runs no exit handler: the job's ownerReference to the step's pod (its uid
    read with a GET of the pod) lets Kubernetes delete the job when that pod goes."""
    step_pod = fake.add_pod("team-a", "rtp-run-train-model-123")
    in_pod(monkeypatch, "rtp-run-train-model-123", "team-a")
    train_until_created(fake, tmp_path, launcher)
    (owner,) = fake.created[0]["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "v1", "kind": "Pod", "name": "rtp-run-train-model-123", "uid": step_pod["metadata"]["uid"],
    }  # fmt: skip
    assert fake.rejected == [] and fake.collected == []


def test_deleting_the_train_steps_pod_deletes_its_job(fake, monkeypatch):
    from components.train.k8s_launcher import step_pod_owner

    pod = fake.add_pod("team-a", "step-pod")
    in_pod(monkeypatch, "step-pod", "team-a", uid=pod["metadata"]["uid"])
    owner = step_pod_owner(api_client(fake), "team-a")
    manifest = job_manifest("trainjob", settings(owner_references=[owner]))
    client.CustomObjectsApi(api_client(fake)).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", "team-a", "trainjobs", manifest
    )
    assert list(fake.jobs) == [("trainjobs", "team-a", "rtp-train-test")]
    fake.delete_pod("team-a", "step-pod")  # what KFP does with a terminated run's pods, in time
    assert fake.jobs == {} and fake.collected == ["rtp-train-test"]


def test_a_job_in_another_namespace_gets_no_owner_and_survives(fake, tmp_path, monkeypatch, caplog):
    """An owner is looked up in its dependent's namespace: a cross-namespace ownerReference
    would make the garbage collector delete the job at once. The job gets none; the exit
    handler and the job's deadline remain."""
    fake.add_pod("kubeflow-user", "step-pod")
    in_pod(monkeypatch, "step-pod", "kubeflow-user")
    train_until_created(fake, tmp_path)
    assert "ownerReferences" not in fake.created[0]["metadata"]
    assert fake.collected == [] and len(fake.deleted) == 1  # deleted on timeout, not by the GC
    assert "no ownerReference" in caplog.text


def test_the_fake_collects_a_job_whose_owner_is_in_another_namespace(fake):
    """Why cross-namespace owners are refused: the fake's garbage collector, like Kubernetes',
    deletes such a job as soon as it is created."""
    pod = fake.add_pod("kubeflow-user", "step-pod")
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "step-pod", "uid": pod["metadata"]["uid"]}
    manifest = job_manifest("pytorchjob", settings(owner_references=[owner]))
    client.CustomObjectsApi(api_client(fake)).create_namespaced_custom_object(
        "kubeflow.org", "v1", "team-a", "pytorchjobs", manifest
    )
    assert fake.collected == ["rtp-train-test"] and fake.jobs == {}


def test_an_unreadable_step_pod_gives_no_owner_and_names_the_permission(fake, monkeypatch, caplog):
    from components.train.k8s_launcher import step_pod_owner

    in_pod(monkeypatch, "no-such-pod", "team-a")
    assert step_pod_owner(api_client(fake), "team-a") is None
    assert "`get` on pods" in caplog.text
    monkeypatch.setenv("POD_UID", "3f1c")  # the downward API's uid needs no API call
    assert step_pod_owner(api_client(fake), "team-a") == {
        "apiVersion": "v1", "kind": "Pod", "name": "no-such-pod", "uid": "3f1c",
    }  # fmt: skip


def test_an_owner_reference_the_schema_rejects_is_refused(fake):
    manifest = job_manifest("pytorchjob", settings())
    manifest["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Pod", "name": "p", "podUID": "x"}
    ]
    with pytest.raises(JobFailed, match="podUID: unknown field"):
        run_job(
            manifest, api_client=api_client(fake), timeout_s=5, poll_interval_s=0.01, write=lambda line: None
        )
    assert "uid: Required value" in fake.rejected[0]


def test_a_pod_waiting_for_an_unbound_pvc_is_told_to_check_the_claim_not_the_gpu_nodes():
    from datetime import UTC, datetime

    from components.train.pod_health import stuck_reason

    message = "0/4 nodes are available: pod has unbound immediate PersistentVolumeClaims."
    pod = {
        "metadata": {"name": "p", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"volumes": [{"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-claim"}}]},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
                 "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ],
        },
    }  # fmt: skip
    reason = stuck_reason(pod, [], now=datetime(2026, 1, 1, 1, tzinfo=UTC), pending_timeout_s=900)
    assert reason is not None and "Check that PVC fsx-claim exists in the namespace and is Bound" in reason
    assert "GPU node group" not in reason


def _run_pod_like_a_kubelet(container: dict, secrets: dict[str, dict[str, str]], workdir: Path) -> None:
    """Run a rendered container's command here as a kubelet would start it: its env (secret
    references read from `secrets`), `$(VAR)` expanded from that env, the engine's rendezvous
    variables on loopback. `python` and `ft_launcher` are this environment's."""
    import re
    import socket
    import subprocess
    import sys

    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
    command = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container["command"]]
    command[0] = sys.executable if command[0] == "python" else command[0]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    log = workdir / "logs" / "train.log"
    assert done.returncode == 0, (
        done.stdout[-3000:],
        done.stderr[-3000:],
        log.exists() and log.read_text()[-3000:],
    )


def test_a_jobs_rank0_logs_its_live_metrics_into_the_mlflow_run_the_train_step_hands_on(
    fake, tmp_path, dataset_dir, mlflow_server
):
    """The rendered PyTorchJob's Master command runs for real (node check, ft_launcher, one
    rank) with the MLflow variables its env reads from the secret: rank 0's live metrics
    land in an MLflow run, and the summary the train step reads from the volume names that
    run, which is the `mlflow_run_id` the step's model artifact hands to validate and
    register (they log into it: tests/integration/test_local_pipeline.py)."""
    import mlflow

    run_folder = tmp_path / "fsx" / "rtp" / "runs" / "r1"
    secrets = {"team-mlflow": {"tracking_uri": mlflow_server, "username": "rtp", "password": "unused"}}

    def master_pod_runs(job: dict) -> None:
        [container] = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
        _run_pod_like_a_kubelet(container, secrets, run_folder / "train")

    fake.on_success = master_pod_runs
    request = TrainRequest(
        dataset_dir=str(dataset_dir), run_folder=run_folder, preset="tiny-cpu",
        settings={"steps": 4, "checkpoint_every": 2, "seed": 1, "checkpoint_mode": "sync"},
        overrides="run.log_every_steps=1",
    )  # fmt: skip
    result = train_with_job(
        "pytorchjob", request, run_id=RUN_ID, namespace="team-a", image="example.com/rtp:1", nproc_per_node=1,
        timeout_s=600, poll_interval_s=0.01, api_client=api_client(fake), nnodes=1, pvc_name="fsx-claim",
        mount_path=str(tmp_path / "fsx"), mlflow_secret_name="team-mlflow",
    )  # fmt: skip
    summary = result.summary
    assert summary.completed and summary.steps == 4 and summary.mlflow_run_id, summary
    tracked = mlflow.MlflowClient(tracking_uri=mlflow_server)
    history = tracked.get_metric_history(summary.mlflow_run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4], history
    assert {m.step: round(m.value, 5) for m in history} == {
        r["step"]: round(r["loss"], 5) for r in summary.losses
    }
    health = run_folder / "train" / "node-health"
    assert [json.loads(p.read_text())["healthy"] for p in health.glob("*.json")] == [True]


def test_a_pod_whose_node_fails_the_node_check_is_moved_off_it_and_the_job_goes_on(fake):
    """The node check exits EXIT_UNHEALTHY_NODE on worker 0's node: the step patches the job
    so new pods avoid that node, deletes the pod, and the operator's replacement (same name,
    new uid) lands elsewhere; the job then finishes. Without the patch the fake's scheduler
    puts the replacement back on the same node, and the job would never finish."""
    fake.default_scenario = Scenario(pod_troubles={1: PodTrouble("unhealthy-node")})
    lines: list[str] = []
    job = run_job(job_manifest("pytorchjob", settings()), api_client=api_client(fake), timeout_s=20,
                  poll_interval_s=0.01, write=lines.append)  # fmt: skip
    assert job["status"]["conditions"][-1]["type"] == "Succeeded"
    assert fake.deleted_pods == ["rtp-train-test-worker-0"] and fake.deleted == []
    [patch] = fake.patches
    for role in ("Master", "Worker"):
        affinity = patch["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["affinity"]
        [term] = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        assert term["matchExpressions"] == [
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["ip-10-0-0-11"]}
        ]
    pods = client.CoreV1Api(api_client(fake)).list_namespaced_pod("team-a").items
    assert {p.metadata.name: p.spec.node_name for p in pods} == {
        "rtp-train-test-master-0": "ip-10-0-0-10",
        "rtp-train-test-worker-0": "ip-10-0-1-0",
    }


def test_a_node_check_failure_the_step_may_not_move_fails_the_job_naming_the_node(fake):
    error = stuck_job(fake, "pytorchjob", {0: PodTrouble("unhealthy-node")}, node_replacements=0)
    assert "node ip-10-0-0-10 of pod rtp-train-test-master-0 failed the node check" in str(error)
    assert "efa: 0 EFA devices" in str(error) and "kubectl cordon ip-10-0-0-10" in str(error)
    assert fake.deleted == ["rtp-train-test"] and fake.patches == []

    fake.deleted.clear()
    trainjob = stuck_job(fake, "trainjob", {1: PodTrouble("unhealthy-node")})
    assert "a TrainJob's pod template cannot change while it runs" in str(trainjob)

    fake.deleted.clear()
    fake.forbidden = {"patch"}
    forbidden = stuck_job(fake, "pytorchjob", {1: PodTrouble("unhealthy-node")})
    assert "the Role needs `patch` on pytorchjobs and `delete` on pods" in str(forbidden)
    assert fake.deleted_pods == []


def test_a_replacement_that_lands_on_the_unhealthy_node_again_is_not_moved_forever(fake, monkeypatch):
    """A patch that did not take effect (here: one that avoids no node) must not loop."""
    import dataclasses

    from components.train import jobs

    no_effect = dataclasses.replace(
        jobs.JOB_KINDS["pytorchjob"], avoiding=lambda manifest, nodes: {"spec": {}}
    )
    monkeypatch.setitem(jobs.JOB_KINDS, "pytorchjob", no_effect)
    error = stuck_job(fake, "pytorchjob", {1: PodTrouble("unhealthy-node")})
    assert "ip-10-0-0-11" in str(error) and "came back to it" in str(error), error
    assert fake.deleted_pods == ["rtp-train-test-worker-0"]


def test_the_fake_validates_a_patch_against_the_crd_like_a_create(fake):
    custom = client.CustomObjectsApi(api_client(fake))
    custom.create_namespaced_custom_object(
        "kubeflow.org", "v1", "team-a", "pytorchjobs", job_manifest("pytorchjob", settings())
    )
    with pytest.raises(client.ApiException) as rejected:
        custom.patch_namespaced_custom_object(
            "kubeflow.org", "v1", "team-a", "pytorchjobs", "rtp-train-test", {"spec": {"notAField": 1}},
            field_validation="Strict",
        )  # fmt: skip
    assert rejected.value.status == 400 and 'unknown field \\"spec.notAField\\"' in rejected.value.body
    with pytest.raises(client.ApiException) as rejected:
        custom.patch_namespaced_custom_object(
            "kubeflow.org",
            "v1",
            "team-a",
            "pytorchjobs",
            "rtp-train-test",
            {"spec": {"runPolicy": {"backoffLimit": "x"}}},
        )
    assert rejected.value.status == 422 and "backoffLimit" in rejected.value.body
    assert fake.patches == []


@pytest.mark.parametrize(
    ("trainer", "missing"),
    [
        ("v2.1.0", "spec.runtimePatches"),  # Kubeflow 1.11's Trainer
        ("v2.2.0", "terminationGracePeriodSeconds"),
    ],
)
def test_a_trainjob_for_a_trainer_older_than_its_fields_is_refused_in_one_line(
    upstream_specs, trainer, missing
):
    with (
        FakeKubernetes(upstream_specs / f"crds-trainer-{trainer}") as fake,
        pytest.raises(JobFailed) as raised,
    ):
        run_job(job_manifest("trainjob", settings()), api_client=api_client(fake), timeout_s=5,
                poll_interval_s=0.01, write=lambda line: None)  # fmt: skip
    message = str(raised.value)
    assert "\n" not in message and missing in message and "v2.3.0 or later" in message, message
    assert fake.jobs == {} and fake.pruned == []  # nothing created without its volumes and tolerations


def test_an_api_server_without_strict_validation_drops_unknown_fields_without_a_word(fake):
    """Why jobs are created with fieldValidation=Strict: the default (Warn) keeps the job."""
    manifest = job_manifest("pytorchjob", settings())
    manifest["spec"]["runPolicy"]["notAField"] = True
    custom = client.CustomObjectsApi(api_client(fake))
    created = custom.create_namespaced_custom_object("kubeflow.org", "v1", "team-a", "pytorchjobs", manifest)
    assert "notAField" not in created["spec"]["runPolicy"] and fake.pruned == ["spec.runPolicy.notAField"]
    manifest["metadata"]["name"] = "rtp-train-strict"
    with pytest.raises(JobFailed, match=r"its CRD has no spec\.runPolicy\.notAField"):
        run_job(
            manifest, api_client=api_client(fake), timeout_s=5, poll_interval_s=0.01, write=lambda line: None
        )
    assert "rtp-train-strict" not in {name for _, _, name in fake.jobs}


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_a_job_without_pods_fails_after_the_pending_timeout_quoting_failedcreate(fake, launcher):
    fake.default_scenario = Scenario(
        outcome="hang",
        pods_refused="exceeded quota: gpu-quota, requested: nvidia.com/gpu=8, limited: nvidia.com/gpu=0",
    )
    with pytest.raises(PodStuck) as raised:
        run_job(job_manifest(launcher, settings()), api_client=api_client(fake), timeout_s=20,
                poll_interval_s=0.01, write=lambda line: None, pending_timeout_s=0.3)  # fmt: skip
    message = str(raised.value)
    assert "has no pod after" in message and "job_pending_timeout_s" in message
    assert "FailedCreate" in message and "exceeded quota: gpu-quota" in message
    assert fake.deleted == ["rtp-train-test"]


@pytest.mark.parametrize("launcher", ["pytorchjob", "trainjob"])
def test_pods_refused_by_pod_security_fail_at_once_naming_the_namespace_choice(fake, launcher):
    refusal = (
        'violates PodSecurity "baseline:latest": non-default capabilities (container "pytorch" must not '
        'include "IPC_LOCK" in securityContext.capabilities.add)'
    )
    fake.default_scenario = Scenario(outcome="hang", pods_refused=refusal)
    with pytest.raises(PodStuck) as raised:  # long before the 900 s a node group may need to scale up
        run_job(job_manifest(launcher, settings()), api_client=api_client(fake), timeout_s=20,
                poll_interval_s=0.01, write=lambda line: None, pending_timeout_s=900)  # fmt: skip
    assert "IPC_LOCK" in str(raised.value) and "job_namespace" in str(raised.value)


def test_a_job_suspended_by_a_queue_waits_without_pods():
    from components.train.k8s_launcher import is_suspended

    queued = {"spec": {"runPolicy": {"suspend": True}}}
    assert is_suspended(queued) and is_suspended({"spec": {"suspend": True}})
    assert is_suspended({"status": {"conditions": [{"type": "Suspended", "status": "True"}]}})
    assert not is_suspended({"spec": {"runPolicy": {"suspend": False}}, "status": {}})
