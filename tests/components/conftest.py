import pytest

from trainer.launch import run_local_training, trainer_arguments


@pytest.fixture(scope="session")
def trained_run(dataset_dir, tmp_path_factory):
    """A real (one-rank) training run with committed checkpoints at steps 10 and 20."""
    workdir = tmp_path_factory.mktemp("trained")
    args = trainer_arguments(
        dataset_dir=str(dataset_dir), workdir=str(workdir), steps=20, checkpoint_every=10, seed=3
    )
    return run_local_training(1, args, workdir, echo=False)
