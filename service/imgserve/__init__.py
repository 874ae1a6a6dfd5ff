"""imgserve: serve PyTorch image models over HTTP with dynamic batching, bounded memory and load shedding."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("imgserve")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"
