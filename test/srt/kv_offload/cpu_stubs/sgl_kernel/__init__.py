"""CPU import-time stand-in for sgl_kernel (see ../README.md)."""

__version__ = "0.0.0+cpustub"
