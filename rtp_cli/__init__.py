"""The `rtp` operator command line: run the pipeline locally, upload, run and schedule it on
Kubeflow Pipelines, render Kubernetes training jobs, and stage or prepare data by hand.

The pipeline definition itself lives in `pipelines/`; this package only drives it.
"""
