"""The rtp pipeline: stage -> train -> validate -> (if good enough) register.

Components are built for a given image at call time, so `rtp compile --image` can point
every step at the image a user pushed. Parameter names match the `rtp` flags and the
trainer's config fields; the docstring's Args become the descriptions in the Kubeflow UI.
"""

# No `from __future__ import annotations`: kfp reads the pipeline signature's real types.

from typing import Any

from kfp import dsl

from components import DEFAULT_IMAGE, as_component
from components.register_model.component import register_model
from components.stage_data.component import stage_data
from components.train.component import train_model
from components.validate_checkpoint.component import validate_checkpoint
from trainer.config import DEFAULT_CHECKPOINT_MODE

PIPELINE_NAME = "rtp-resilient-training"
DEFAULT_SOURCE = "s3://rtp-demo/corpus/"
DEFAULT_MODEL_NAME = "rtp-byte-lm"


def pipeline_version() -> str:
    """The pipeline definition's version, recorded on every registered model version."""
    import importlib.metadata

    try:
        return f"{PIPELINE_NAME}-{importlib.metadata.version('rtp')}"
    except importlib.metadata.PackageNotFoundError:
        return f"{PIPELINE_NAME}-unknown"


def build_pipeline(image: str = DEFAULT_IMAGE) -> Any:
    stage_op = as_component(stage_data, image)
    train_op = as_component(train_model, image)
    validate_op = as_component(validate_checkpoint, image)
    register_op = as_component(register_model, image)

    @dsl.pipeline(
        name=PIPELINE_NAME,
        description="Stage data from S3 to FSx, train with FSDP and "
        "resilient checkpoints, validate the checkpoint, register the model in MLflow.",
    )
    def rtp_pipeline(
        source: str = DEFAULT_SOURCE,
        s3_endpoint_url: str = "",
        fsx_mount_path: str = "/fsx",
        dataset_name: str = "demo-corpus",
        run_name: str = "",
        steps: int = 40,
        nproc: int = 2,
        checkpoint_every: int = 10,
        checkpoint_mode: str = DEFAULT_CHECKPOINT_MODE,
        seed: int = 1234,
        preset: str = "tiny-cpu",
        overrides: str = "",
        max_loss: float = 4.0,
        min_improvement: float = 0.0,
        model_name: str = DEFAULT_MODEL_NAME,
    ) -> None:
        """Resilient training: stage, train, validate, register.

        Args:
            source: S3 prefix holding the training text, as s3://bucket/prefix.
            s3_endpoint_url: S3-compatible endpoint URL; leave empty for AWS S3.
            fsx_mount_path: Mount path of the FSx for Lustre volume in every step.
            dataset_name: Dataset folder name under <mount>/rtp/datasets.
            run_name: Run folder name under <mount>/rtp/runs; empty uses the KFP run id. Reuse a name to resume its checkpoints.
            steps: Total training steps.
            nproc: Training processes in the train pod (GPUs per node, or CPU processes).
            checkpoint_every: Save a checkpoint every N steps.
            checkpoint_mode: How checkpoints are written: async (NVRx, overlaps the write with training), torch-async, sync, or off.
            seed: Random seed for weights and data order.
            preset: Model size preset: tiny-cpu, small-cpu or gpu-125m.
            overrides: Extra trainer config as 'section.field=value' items separated by spaces, e.g. 'optimizer.lr=1e-3'.
            max_loss: Highest holdout loss (nats per byte) a model may have to be registered.
            min_improvement: How much lower than the current champion's holdout loss a model's must be to become champion; otherwise it is registered as challenger.
            model_name: Registered model name in MLflow.
        """
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        stage = stage_op(
            source=source,
            s3_endpoint_url=s3_endpoint_url,
            fsx_mount_path=fsx_mount_path,
            dataset_name=dataset_name,
            run_name=run_name,
            run_id=run_id,
        ).set_display_name("Stage the dataset from S3 onto FSx")
        train = train_op(
            dataset=stage.outputs["dataset"],
            fsx_mount_path=fsx_mount_path,
            run_name=run_name,
            run_id=run_id,
            steps=steps,
            nproc=nproc,
            checkpoint_every=checkpoint_every,
            checkpoint_mode=checkpoint_mode,
            seed=seed,
            preset=preset,
            overrides=overrides,
        ).set_display_name("Train the model with FSDP and checkpoints")
        validate = validate_op(
            model=train.outputs["model"],
            dataset=stage.outputs["dataset"],
            fsx_mount_path=fsx_mount_path,
            run_name=run_name,
            run_id=run_id,
            max_loss=max_loss,
            min_improvement=min_improvement,
            model_name=model_name,
            # Every checkpoint the train step commits is a resume point: it must hold optimizer state.
            require_optimizer_state=True,
        ).set_display_name("Validate the checkpoint on held-out data")
        for task in (stage, train, validate):
            # Each step writes to the shared volume: a cached result could point at a
            # folder another run has since changed, so nothing is cached for now.
            task.set_caching_options(False)
        with dsl.If(validate.outputs["Output"] != "reject", name="model-is-good-enough"):
            register_op(
                model=train.outputs["model"],
                dataset=stage.outputs["dataset"],
                decision=validate.outputs["Output"],
                model_name=model_name,
                fsx_mount_path=fsx_mount_path,
                run_name=run_name,
                run_id=run_id,
                pipeline_version=pipeline_version(),
            ).set_display_name("Register the model in MLflow").set_caching_options(False)

    return rtp_pipeline


def compile_pipeline(output_path: str, image: str = DEFAULT_IMAGE) -> str:
    from kfp import compiler

    compiler.Compiler().compile(build_pipeline(image), package_path=output_path)
    return output_path
