"""GPU benchmark of generated attention kernels against SDPA, FlexAttention and eager PyTorch (see docs/bench.md)."""
