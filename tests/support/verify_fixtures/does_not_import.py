"""A candidate whose import fails (a missing extension module)."""
import torch.nn as nn
import my_missing_cuda_extension  # noqa: F401


class ModelNew(nn.Module):
    pass
