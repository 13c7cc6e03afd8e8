"""A one-rank training process that starts the async writer as a restart does (background
warm-up: the writer process is still importing torch) and is then SIGKILLed, as a rank is
by a fault. Run by test_faults.py; its argument is a scratch checkpoint folder."""

import os
import signal
import sys

if __name__ == "__main__":  # the writer is spawned: it imports this module again
    from pathlib import Path

    import torch.distributed as dist

    from trainer.checkpointing.nvrx_writer import NvrxAsyncWriter

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    writer = NvrxAsyncWriter(Path(sys.argv[1]), 2, 0, lambda record: None)
    writer.open(background=True)
    os.kill(os.getpid(), signal.SIGKILL)
