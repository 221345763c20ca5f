from . import InterpolationMode  # noqa: F401


def __getattr__(name):
    raise AttributeError(f"torchvision.transforms.functional.{name}: CPU stand-in")
