"""The event log (trainer/events.py) and atomic JSON writes."""

import json

from trainer.events import EventLog, write_json_atomic


def test_events_and_atomic_json(tmp_path):
    log = EventLog(tmp_path, enabled=True)
    log.emit("step", step=1, loss=2.0)
    EventLog(tmp_path / "other", enabled=False).emit("step", step=1)
    assert json.loads((tmp_path / "events.jsonl").read_text())["loss"] == 2.0
    assert not (tmp_path / "other").exists()
    write_json_atomic(tmp_path / "s.json", {"a": 1})
    assert json.loads((tmp_path / "s.json").read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
