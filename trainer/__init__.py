"""Everything that runs inside a training rank: config, model, data, FSDP2, checkpoints, loop.

Nothing here creates distributed state at import time; `python -m trainer` is the entry
point a launcher (torchrun today, ft_launcher later) starts once per rank.
"""

import trainer.models  # noqa: F401  registers the model kinds' rules with trainer.config
