"""`rtp local` drops kfp.local's executor chatter and keeps the steps' own lines."""

import pytest

from rtp_cli.local_console import ExecutorChatterFilter

pytestmark = pytest.mark.timeout(10)

STREAM = """\
[KFP Executor 2026-11-30 13:13:53,878 INFO]: Looking for component `train_model` in --component_module_path `/tmp/x.py`
[KFP Executor 2026-11-30 13:13:53,878 INFO]: Loading KFP component "train_model" from /tmp/x.py
[KFP Executor 2026-11-30 13:13:53,879 INFO]: Got executor_input:
{
    "inputs": {
        "parameterValues": {"steps": 10}
    }
}
[rank1]:[W1130 13:15:05.012098222 socket.cpp:469] [c10d] waitForInput: poll for socket returned 0, likely a timeout
[rank0]: step 5/10 loss 4.2000 tokens/s 9000 eta 0:00:01
[KFP Executor 2026-11-30 13:13:54,100 INFO]: checkpoint step 10 committed
[KFP Executor 2026-11-30 13:13:54,942 INFO]: Wrote executor output file to /tmp/out.json
"""


def test_only_the_steps_own_lines_are_kept():
    lines = ExecutorChatterFilter()
    kept = [line for line in STREAM.splitlines(keepends=True) if lines.keep(line)]
    assert kept == [
        "[rank0]: step 5/10 loss 4.2000 tokens/s 9000 eta 0:00:01\n",
        "[KFP Executor 2026-11-30 13:13:54,100 INFO]: checkpoint step 10 committed\n",
    ]
