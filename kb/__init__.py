"""kernel-kb: a knowledge base of expert GPU attention kernels."""

__version__ = "0.1.0"
