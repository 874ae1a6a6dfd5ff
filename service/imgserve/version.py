"""The installed imgserve's version (0.0.0 when running from a source tree that was not installed)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("imgserve")
except PackageNotFoundError:
    __version__ = "0.0.0"
