"""The `rtp` operator command line, apart from the pipeline definition in `pipelines/`.

It runs the whole pipeline on one machine (`rtp local`), compiles it, operates it on
Kubeflow Pipelines (upload, run, schedule, runs), renders the multi-node training job, and
runs single steps (stage, prepare-data, train-local, validate, register) and benchmarks by
hand. `rtp_cli.main` is the entry point; each subcommand calls the function its step calls.
"""
