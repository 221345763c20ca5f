from .. import InterpolationMode  # noqa: F401


def __getattr__(name):
    raise AttributeError(f"torchvision.transforms.v2.functional.{name}: CPU stand-in")
