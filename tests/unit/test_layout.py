"""Run and dataset folders on the shared volume (components/layout.py) and the names they accept."""

import pytest

from components.layout import check_name, dataset_root, run_dir


def test_run_dir_prefers_run_name_then_job_id(tmp_path):
    assert run_dir(tmp_path, "nightly", "123") == tmp_path / "rtp/runs/nightly"
    assert run_dir(tmp_path, "", "123") == tmp_path / "rtp/runs/123"
    with pytest.raises(ValueError, match="run name"):
        run_dir(tmp_path, "", "")
    assert dataset_root(tmp_path, "corpus") == tmp_path / "rtp/datasets/corpus"


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "x" * 200, "nightly\n"])
def test_unsafe_folder_names_are_refused(name):
    with pytest.raises(ValueError, match="safe folder name"):
        check_name("run name", name)
