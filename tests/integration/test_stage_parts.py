"""Staging across workers against a real S3 server (Ceph RGW): N `rtp stage --part I/N`
processes and one `--finish N` give the snapshot one stage gives; a missing part stops the
finisher, and that part retried alone completes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from components.stage_data.parts import _staged, assign_parts, finish_stage, stage_part
from components.stage_data.source import SourceObject
from components.stage_data.stage import StageError, stage_dataset
from tests.integration.test_stage_ceph import SETTINGS, _assert_snapshot, _seed

# One Ceph cluster per session: under `make test`'s two workers these run on the same one.
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def seeded(ceph_s3):
    from components.stage_data.stage import s3_client

    return ceph_s3, _seed(s3_client(ceph_s3.endpoint_url), "stage-parts"), "stage-parts"


def _entries(snapshot: Path) -> tuple[dict, list[dict]]:
    """The manifest without what differs between two stagings of the same listing (when, mtimes)."""
    manifest = json.loads((snapshot / "manifest.json").read_text())
    head = {k: v for k, v in manifest.items() if k not in ("files", "staged_at")}
    return head, [{k: v for k, v in e.items() if k != "mtime_ns"} for e in manifest["files"]]


def _stage_command(endpoint: str, bucket: str, dest: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "rtp_cli.main", "stage", "--source", f"s3://{bucket}/data/",
        "--endpoint-url", endpoint, "--fsx-mount-path", str(dest), "--dataset-name", "ds",
        "--max-workers", "4", "--multipart-threshold-mib", "4", "--part-size-mib", "4", *extra,
    ]  # fmt: skip


def test_parts_are_balanced_by_bytes_and_the_same_on_every_worker():
    objects = [SourceObject("big-a", 100, "e"), SourceObject("big-b", 90, "e")]
    objects += [SourceObject(f"s{i}", 1, "e") for i in range(10)]
    parts = assign_parts(objects, 2)
    assert {o.key for o in parts[0]} & {"big-a", "big-b"} != {"big-a", "big-b"}, "the two big ones split"
    assert sorted(o.key for p in parts for o in p) == sorted(o.key for o in objects)
    assert parts == assign_parts(list(reversed(objects)), 2), "the listing's order does not matter"
    assert [len(p) for p in assign_parts(objects, 1)] == [12]


def test_the_finisher_accepts_only_regular_files_of_the_recorded_size(tmp_path):
    (tmp_path / "ok").write_bytes(b"abc")
    (tmp_path / "short").write_bytes(b"ab")
    (tmp_path / "link").symlink_to(tmp_path / "ok")  # the right size through a link: refused
    (tmp_path / "file").write_bytes(b"abc")  # a file where a folder is expected
    keys = ["ok", "short", "link", "missing", "under-file"]
    paths = {"ok": "ok", "short": "short", "link": "link", "missing": "missing", "under-file": "file/x"}
    items = [(key, SourceObject(key, 3, "e")) for key in keys]
    bad, mtimes = _staged(str(tmp_path), paths, items)
    assert [key for _, key in bad] == keys[1:]
    assert mtimes == {"ok": (tmp_path / "ok").stat().st_mtime_ns}, "what the commit records"


def test_two_part_processes_and_a_finisher_give_the_snapshot_one_stage_gives(seeded, tmp_path):
    server, expected, bucket = seeded
    single = stage_dataset(
        f"s3://{bucket}/data/", str(tmp_path / "one"), "ds", server.endpoint_url, settings=SETTINGS
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parts = [
        subprocess.Popen(_stage_command(server.endpoint_url, bucket, tmp_path / "two", "--part", f"{i}/2"),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]  # fmt: skip
    records = []
    for process in parts:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        records.append(json.loads(out))
    assert not (tmp_path / "two/rtp/datasets/ds/current").exists(), "no part commits"
    assert sum(r["files_downloaded"] for r in records) == len(expected)
    assert all(r["files_downloaded"] > 0 for r in records), records
    finish = subprocess.run(_stage_command(server.endpoint_url, bucket, tmp_path / "two", "--finish", "2"),
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert finish.returncode == 0, finish.stderr[-3000:]
    result = json.loads(finish.stdout)
    assert result["snapshot_id"] == single.snapshot_id
    assert result["bytes_downloaded"] == single.bytes_downloaded == sum(map(len, expected.values()))
    current = tmp_path / "two/rtp/datasets/ds/current"
    _assert_snapshot(current, expected)
    assert _entries(current) == _entries(tmp_path / "one/rtp/datasets/ds/current")
    assert not list((tmp_path / "two/rtp/datasets/ds/.staging").iterdir()), "staging and part records gone"

    again = finish_stage(f"s3://{bucket}/data/", str(tmp_path / "two"), "ds", 2,
                         endpoint_url=server.endpoint_url, settings=SETTINGS)  # fmt: skip
    assert (again.files_downloaded, again.snapshot_id) == (0, single.snapshot_id), "unchanged: re-checked"
    skipped = stage_part(f"s3://{bucket}/data/", str(tmp_path / "two"), "ds", 1, 2,
                         endpoint_url=server.endpoint_url, settings=SETTINGS)  # fmt: skip
    assert skipped["already_staged"] is True


def test_a_missing_part_stops_the_finisher_and_that_part_alone_completes_it(seeded, tmp_path):
    server, expected, bucket = seeded
    where = (f"s3://{bucket}/data/", str(tmp_path), "ds")
    options = {"endpoint_url": server.endpoint_url, "settings": SETTINGS}
    first = stage_part(*where, 0, 3, **options)
    third = stage_part(*where, 2, 3, **options)
    with pytest.raises(StageError, match=r"part 1 of 3 of snapshot \w+ has no record"):
        finish_stage(*where, 3, **options)
    assert not (tmp_path / "rtp/datasets/ds/current").exists()
    second = stage_part(*where, 1, 3, **options)
    assert second["files_reused"] == 0 and second["files_downloaded"] == len(second["files"])
    # A recorded part's file lost or cut short after its record: the finisher names that part.
    staging = tmp_path / "rtp/datasets/ds/.staging" / third["snapshot_id"]
    lost, cut = (staging / third["files"][0]["path"]), (staging / third["files"][1]["path"])
    lost.unlink()
    cut.write_bytes(cut.read_bytes()[:-1])
    with pytest.raises(
        StageError, match=r"and 1 more file\(s\) are missing or incomplete: run part\(s\) 2 of 3"
    ):
        finish_stage(*where, 3, **options)
    assert not (tmp_path / "rtp/datasets/ds/current").exists()
    third = stage_part(*where, 2, 3, **options)
    assert third["files_downloaded"] == 2 and third["files_reused"] == len(third["files"]) - 2
    done = finish_stage(*where, 3, **options)
    assert (
        done.files_downloaded
        == first["files_downloaded"] + second["files_downloaded"] + third["files_downloaded"]
    )
    _assert_snapshot(tmp_path / "rtp/datasets/ds/current", expected)
    with pytest.raises(StageError, match="0 <= part < parts"):
        stage_part(*where, 3, 3, **options)


def _step_pod(fsx: Path) -> dict:
    """The stage step's pod as the API shows it: KFP's `main` container with the FSx mount."""
    return {
        "metadata": {"name": "rtp-run-stage-data-abc", "namespace": "team-a"},
        "spec": {
            "serviceAccountName": "default-editor",
            "nodeSelector": {"rtp.kubeflow.org/pool": "cpu"},
            "containers": [
                {"name": "wait", "image": "kfp-launcher"},
                {
                    "name": "main",
                    "image": "example.com/rtp:1",
                    "env": [
                        {"name": "AWS_REGION", "value": "us-east-1"},
                        {"name": "KFP_POD_NAME", "value": "x"},
                    ],
                    "volumeMounts": [
                        {"name": "fsx", "mountPath": str(fsx)},
                        {"name": "kfp-launcher", "mountPath": "/kfp-launcher"},
                    ],
                },
            ],
            "volumes": [
                {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-claim"}},
                {"name": "kfp-launcher", "emptyDir": {}},
            ],
        },
    }


def _run_indexed_job_here(job: dict) -> dict:
    """What the Job controller and kubelets would do: every index's pod command at once, with
    JOB_COMPLETION_INDEX set and `$(VAR)` expanded; the Job's final status."""
    import re

    [container] = job["spec"]["template"]["spec"]["containers"]
    count = job["spec"]["completions"]
    runs = []
    for index in range(count):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JOB_COMPLETION_INDEX": str(index)}
        env.update({e["name"]: e["value"] for e in container.get("env", [])})
        command = [
            re.sub(r"\$\((\w+)\)", lambda m, env=env: env[m.group(1)], a) for a in container["command"]
        ]
        command[0] = sys.executable if command[0] == "python" else command[0]
        runs.append(
            subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    failed = [i for i, run in enumerate(runs) if run.wait(timeout=300) != 0]
    if failed:
        return {"failed": len(failed), "failedIndexes": ",".join(map(str, failed)),
                "conditions": [{"type": "Failed", "status": "True", "reason": "FailedIndexes",
                                "message": "Job has failed indexes"}]}  # fmt: skip
    return {"succeeded": count, "completedIndexes": f"0-{count - 1}",
            "conditions": [{"type": "Complete", "status": "True"}]}  # fmt: skip


@pytest.fixture
def fake_api(upstream_specs):
    from kubernetes import client

    from tests.fakes.kube_api import FakeKubernetes

    with FakeKubernetes(upstream_specs / "crds") as server:
        configuration = client.Configuration()
        configuration.host = server.url
        yield server, client.ApiClient(configuration)


def test_the_stage_step_stages_across_an_indexed_jobs_pods_then_commits(seeded, tmp_path, fake_api):
    from components.stage_data.stage_job import stage_across_pods

    server, expected, bucket = seeded
    fake, api_client = fake_api
    fake.batch_runner = _run_indexed_job_here
    single = stage_dataset(
        f"s3://{bucket}/data/", str(tmp_path / "one"), "ds", server.endpoint_url, settings=SETTINGS
    )
    fsx = tmp_path / "two"
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "rtp-run-stage-data-abc", "uid": "u1"}
    result = stage_across_pods(
        f"s3://{bucket}/data/", str(fsx), "ds", 2, endpoint_url=server.endpoint_url, api_client=api_client,
        read_step_pod=lambda: (_step_pod(fsx), owner), poll_interval_s=0.05,
    )  # fmt: skip
    assert result.snapshot_id == single.snapshot_id and result.files_downloaded == len(expected)
    assert _entries(fsx / "rtp/datasets/ds/current") == _entries(tmp_path / "one/rtp/datasets/ds/current")
    [job] = fake.batch_jobs.values()
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (
        spec["completionMode"],
        spec["completions"],
        spec["backoffLimitPerIndex"],
        spec["maxFailedIndexes"],
    ) == (
        "Indexed",
        2,
        3,
        0,
    )  # a failed part is retried alone; one out of retries fails the Job
    assert pod["serviceAccountName"] == "default-editor" and pod["nodeSelector"] == {
        "rtp.kubeflow.org/pool": "cpu"
    }
    assert [v["name"] for v in pod["volumes"]] == ["fsx"] and pod["containers"][0][
        "image"
    ] == "example.com/rtp:1"
    assert pod["containers"][0]["env"] == [{"name": "AWS_REGION", "value": "us-east-1"}]
    assert pod["containers"][0]["command"][-2:] == ["--part", "$(JOB_COMPLETION_INDEX)/2"]
    assert job["metadata"]["ownerReferences"] == [owner] and fake.deleted_batch_jobs == []


def test_a_part_job_that_fails_ends_the_step_naming_the_parts_and_is_deleted(seeded, tmp_path, fake_api):
    from components.stage_data.stage_job import stage_across_pods

    server, _, bucket = seeded
    fake, api_client = fake_api
    fake.batch_runner = lambda job: {
        "failed": 4, "failedIndexes": "1",
        "conditions": [{"type": "Failed", "status": "True", "reason": "FailedIndexes", "message": "Job has failed indexes"}],
    }  # fmt: skip
    fsx = tmp_path / "fsx"
    with pytest.raises(StageError, match=r"failed: Job has failed indexes; failed parts: 1"):
        stage_across_pods(f"s3://{bucket}/data/", str(fsx), "ds", 2, endpoint_url=server.endpoint_url,
                          api_client=api_client, read_step_pod=lambda: (_step_pod(fsx), None), poll_interval_s=0.05)  # fmt: skip
    assert fake.deleted_batch_jobs == ["rtp-run-stage-data-abc-parts"]
    assert not (fsx / "rtp/datasets/ds/current").exists()


def test_without_a_cluster_the_parts_run_as_local_processes(seeded, tmp_path, monkeypatch):
    from components.stage_data.stage_job import stage_across_pods

    server, expected, bucket = seeded
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = stage_across_pods(
        f"s3://{bucket}/data/", str(tmp_path), "ds", 3, endpoint_url=server.endpoint_url
    )
    assert result.files_downloaded == len(expected)
    _assert_snapshot(tmp_path / "rtp/datasets/ds/current", expected)
    with pytest.raises(StageError, match="needs at least 2"):
        stage_across_pods(f"s3://{bucket}/data/", str(tmp_path), "ds", 1)
