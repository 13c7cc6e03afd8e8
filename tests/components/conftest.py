import pytest

from trainer.config import resolve_config


@pytest.fixture(scope="session")
def trained_run(dataset_dir, tmp_path_factory):
    """A real (one-rank) training run with committed (synchronous) checkpoints at steps 10 and 20."""
    from tests.conftest import shared_json
    from tests.distributed.conftest import run_training

    def run(workdir):
        config = resolve_config(
            named={
                "dataset_dir": str(dataset_dir),
                "workdir": str(workdir),
                "steps": 20,
                "checkpoint_every": 10,
                "seed": 3,
                "checkpoint_mode": "sync",  # what validate and register read is the same in every mode
            }
        )
        return run_training(1, config)

    # One run for both xdist workers; no test changes its files (damage is done to copies).
    return shared_json(tmp_path_factory, "trained", run)
