"""A candidate that starts a worker process and then never returns (the worker never ends either).

The worker's command line ends with the name of the directory this file is in (the sandbox passes no
test-specific environment variable), so a test that copies it into a uniquely named directory can find the
worker (and its process group) in /proc.
"""
import subprocess
import sys
import time
from pathlib import Path

import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()

    def forward(self, q, k, v):
        marker = Path(__file__).resolve().parent.name
        subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.5)", marker])
        while True:
            time.sleep(0.2)
