"""KFP interface of the stage step: S3 prefix -> dataset snapshot on the shared volume (fetched
here, or with stage_workers > 1 by the pods of an Indexed Job: components/stage_data/stage_job.py)."""

from kfp.dsl import Dataset, Metrics, Output


def stage_data(
    source: str,
    s3_endpoint_url: str,
    fsx_mount_path: str,
    dataset_name: str,
    run_name: str,
    run_id: str,
    dataset: Output[Dataset],
    metrics: Output[Metrics],
    stage_workers: int = 1,
) -> None:
    """Copy an S3 prefix into an immutable, verified dataset snapshot on the FSx volume.

    Args:
        source: s3://bucket/prefix to stage.
        s3_endpoint_url: S3-compatible endpoint; empty for AWS (credentials come from the pod's service account).
        fsx_mount_path: where the FSx PVC is mounted in the pod.
        dataset_name: folder name of the dataset under <mount>/rtp/datasets/.
        run_name: run folder name; empty uses the KFP run id.
        run_id: the KFP run id (filled in by the pipeline).
        dataset: the snapshot: manifest.json as content, snapshot path and counts as metadata.
        metrics: files, bytes and MiB/s.
        stage_workers: pods that fetch the objects, a share each (an Indexed Job this step creates and waits for) before this step commits the snapshot; 1 fetches them here.
    """
    import logging
    import shutil
    import time

    from components.layout import record_step, run_dir
    from components.stage_data.stage import stage_dataset
    from components.stage_data.stage_job import stage_across_pods

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.time()
    endpoint = s3_endpoint_url or None
    if int(stage_workers) > 1:
        result = stage_across_pods(
            source, fsx_mount_path, dataset_name, int(stage_workers), endpoint_url=endpoint
        )
    else:
        result = stage_dataset(source, fsx_mount_path, dataset_name, endpoint_url=endpoint)
    shutil.copyfile(f"{result.snapshot_dir}/manifest.json", dataset.path)
    dataset.metadata.update(result.as_dict())
    for name in ("files", "bytes_total", "bytes_downloaded", "mib_per_s", "seconds"):
        metrics.log_metric(name, result.as_dict()[name])
    record_step(run_dir(fsx_mount_path, run_name, run_id), "stage", started, **result.as_dict())
