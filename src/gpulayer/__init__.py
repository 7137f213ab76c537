"""GPUlayer: run ML jobs on the GPU machines you already own."""

__version__ = "0.1.0"
