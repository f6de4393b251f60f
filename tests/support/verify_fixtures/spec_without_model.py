"""A broken spec: get_inputs but no Model."""
import torch


def get_inputs():
    return [torch.randn(1, 2, 16, 16) for _ in range(3)]


def get_init_inputs():
    return []
