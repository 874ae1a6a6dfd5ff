"""The repository's `detector`: examples/detector.py's YOLO-style DetectorAPI (letterbox, a seeded conv head, NMS in
torch), served from this folder. The repository names it by the folder (`detector`, /v2/models/detector) and its
config.yaml gives its path and batch size. A module's name must be its own across the repository's folders: each
folder is put on the import path and the module imported by that name."""

from examples.detector import DetectorAPI

__all__ = ["DetectorAPI"]
