"""Straggler scores, the slow drill's spec, and where a report is shown (trainer/stragglers.py)."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, build_config
from trainer.faults import FaultSpec, FaultSpecError, parse_fault, parse_faults
from trainer.progress import Progress
from trainer.report import stragglers_html
from trainer.stragglers import scores


def test_a_rank_slower_than_the_others_median_is_named():
    report = scores([0.010, 0.011, 0.030, 0.009], ["a", "a", "b", "b"], threshold=1.5)
    assert report["slow"] == [2]
    assert report["ranks"][2] == {"rank": 2, "host": "b", "local_s": 0.03, "relative": 3.0}
    assert all(r["relative"] < 1.5 for r in report["ranks"] if r["rank"] != 2)
    two = scores([0.010, 0.310], ["a", "b"], threshold=1.5)  # against the other rank, not the mean
    assert two["slow"] == [1] and two["ranks"][1]["relative"] == 31.0
    assert scores([0.01, 0.01], ["a", "b"], 1.5)["slow"] == []
    assert scores([0.02], ["a"], 1.5)["slow"] == []  # alone: nobody to be slower than


def test_the_slow_drill_takes_milliseconds_and_other_kinds_refuse_them():
    assert parse_fault("slow@5:1:300") == FaultSpec("slow", 5, 1, 300)
    assert parse_fault("slow@5") == FaultSpec("slow", 5, 0, 200)
    assert str(parse_fault("slow@5:1:300")) == "slow@5:1:300"
    with pytest.raises(FaultSpecError, match="only a slow fault takes milliseconds"):
        parse_fault("exception@5:1:300")
    assert [f.kind for f in parse_faults("slow@2:1:50,exception@4")] == ["slow", "exception"]


def test_straggler_settings_are_checked():
    with pytest.raises(ConfigError, match="straggler_threshold"):
        build_config("tiny-cpu", ["resilience.straggler_threshold=1.0"])
    with pytest.raises(ConfigError, match="straggler_every_steps"):
        build_config("tiny-cpu", ["resilience.straggler_every_steps=-1"])


def test_the_report_reaches_the_log_mlflow_and_goodput_html(caplog):
    report = {"steps": [1, 8], "threshold": 1.5, **scores([0.01, 0.3], ["node-a", "node-b"], 1.5)}

    class Live:
        def __init__(self):
            self.logged, self.tags = [], {}

        def log(self, metrics, step):
            self.logged.append((metrics, step))

        def set_tags(self, tags):
            self.tags.update(tags)

    progress = Progress(build_config("tiny-cpu"), rank=0, world_size=2)
    progress.live = Live()
    with caplog.at_level("WARNING"):
        progress.on_stragglers(report)
    assert "rank 1 on node-b took 30.00x" in caplog.text and "steps 1-8" in caplog.text
    assert progress.live.logged == [({"straggler.max_relative": 30.0, "straggler.slow_ranks": 1.0}, 8)]
    assert progress.live.tags == {"rtp.stragglers": "rank 1"}
    page = stragglers_html(report)
    assert "<b>rank 1</b>" in page and "node-b" in page and page.index("node-b") < page.index("node-a")
    assert "No comparison" in stragglers_html({})


def test_old_teardown_folders_are_pruned_so_diagnostics_do_not_pile_up(tmp_path):
    import os

    from trainer import diagnostics

    root = tmp_path / "diagnostics"
    for i in range(8):
        (root / f"restart0-attempt{i}").mkdir(parents=True)
        os.utime(root / f"restart0-attempt{i}", (i, i))
    assert diagnostics.dump_stacks(root / "restart0-attempt7", rank=0)
    diagnostics.prune(root / "restart0-attempt7")
    kept = sorted(p.name for p in root.iterdir())
    assert kept == [f"restart0-attempt{i}" for i in range(8 - diagnostics.KEEP_TEARDOWNS, 8)]
    assert "in dump_stacks" in (root / "restart0-attempt7" / "stacks_rank_0.txt").read_text()
