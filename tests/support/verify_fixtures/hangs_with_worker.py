"""A candidate that starts a worker process and then never returns (the worker never ends either).

The worker's command line carries $HANG_MARKER, so a test can find it (and its process group) in /proc.
"""
import os
import subprocess
import sys
import time

import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()

    def forward(self, q, k, v):
        marker = os.environ.get("HANG_MARKER", "hang-marker")
        subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.5)", marker])
        while True:
            time.sleep(0.2)
