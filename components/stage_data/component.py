"""KFP interface of the stage step: S3 prefix -> dataset snapshot on the shared volume."""

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
    """
    import logging
    import shutil
    import time

    from components.layout import record_step, run_dir
    from components.stage_data.stage import stage_dataset

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.time()
    result = stage_dataset(source, fsx_mount_path, dataset_name, endpoint_url=s3_endpoint_url or None)
    shutil.copyfile(f"{result.snapshot_dir}/manifest.json", dataset.path)
    dataset.metadata.update(result.as_dict())
    for name in ("files", "bytes_total", "bytes_downloaded", "mib_per_s", "seconds"):
        metrics.log_metric(name, result.as_dict()[name])
    record_step(run_dir(fsx_mount_path, run_name, run_id), "stage", started, **result.as_dict())
