"""CPU import-time stand-in for torchvision (see ../README.md)."""

__version__ = "0.0.0+cpustub"
from . import io, transforms  # noqa: E402,F401
