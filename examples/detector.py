"""A YOLO-style detector: letterbox before the model, non-maximum suppression after it, boxes in the upload's pixels.

- `decode_request` (front end): the upload scaled to fit 320 x 320 without distortion and padded with gray (the
  letterbox); the scale and the padding go in `request.context` for the way back.
- `predict` (worker, on the batch): a small convolutional head (random weights from a fixed seed: put a trained
  one in its place) predicts, per cell of a 10 x 10 grid, a box, an objectness and class scores; the boxes above
  the score threshold go through non-maximum suppression per class, written with torch operations.
- `encode_response` (front end): the boxes mapped back from the letterbox to the upload and clipped to it.

    imgserve serve --api examples.detector:DetectorAPI
    curl -F file=@street.jpg localhost:8000/predict
    # {"width": 640, "height": 480, "detections": [{"box": [12.5, 40.0, 210.2, 300.8], "score": 0.71, "class": 2}]}
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from imgserve import ImageAPI, Request

SEED = 0
SIZE = 320  # the model's input: SIZE x SIZE
STRIDE = 32  # pixels per grid cell
CLASSES = 3
ANCHOR = 64.0  # a box's side in pixels when its size logit is 0
SCORE_THRESHOLD = 0.3
IOU_THRESHOLD = 0.45
MAX_CANDIDATES = 300  # best-scored boxes per image that enter NMS
MAX_DETECTIONS = 50
PAD_VALUE = 114  # the letterbox's gray


def head() -> nn.Module:
    """Five stride-2 convolutions (320 -> 10) and a 1x1 convolution to 4 box + 1 objectness + CLASSES logits, with
    random weights that keep the signal's scale from layer to layer (so the scores differ from cell to cell)."""
    layers: list[nn.Module] = []
    channels = 3
    for width in (16, 32, 64, 64, 64):
        layers += [nn.Conv2d(channels, width, 3, stride=2, padding=1), nn.SiLU()]
        channels = width
    model = nn.Sequential(*layers, nn.Conv2d(channels, 5 + CLASSES, 1))
    for layer in model:
        if isinstance(layer, nn.Conv2d):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
    nn.init.normal_(model[-1].weight, std=0.5)
    return model


def letterbox(image: Image.Image) -> tuple[np.ndarray, float, tuple[int, int]]:
    """The image scaled to fit SIZE x SIZE and centred on gray: its uint8 pixels, the scale and the (x, y) offset."""
    scale = min(SIZE / image.width, SIZE / image.height)
    width, height = max(1, round(image.width * scale)), max(1, round(image.height * scale))
    offset = ((SIZE - width) // 2, (SIZE - height) // 2)
    canvas = Image.new("RGB", (SIZE, SIZE), (PAD_VALUE,) * 3)
    canvas.paste(image.resize((width, height), Image.Resampling.BILINEAR), offset)
    return np.asarray(canvas), scale, offset


def decode_grid(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's N x (5 + CLASSES) x G x G output -> boxes N x G*G x 4 (left, top, right, bottom in letterbox
    pixels), scores and classes N x G*G."""
    n, _, rows, columns = raw.shape
    raw = raw.permute(0, 2, 3, 1).reshape(n, rows * columns, -1)
    y, x = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
    grid = torch.stack([x, y], dim=-1).reshape(1, -1, 2).to(raw)
    centre = (grid + raw[..., 0:2].sigmoid()) * STRIDE
    size = ANCHOR * raw[..., 2:4].clamp(-4, 4).exp()
    boxes = torch.cat([centre - size / 2, centre + size / 2], dim=-1)
    scores, classes = (raw[..., 4:5].sigmoid() * raw[..., 5:].sigmoid()).max(dim=-1)
    return boxes, scores, classes


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Intersection over union of every box of `a` (A x 4) with every box of `b` (B x 4): A x B."""
    top_left = torch.maximum(a[:, None, :2], b[None, :, :2])
    bottom_right = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    intersection = (bottom_right - top_left).clamp(min=0).prod(dim=-1)
    area_a = (a[:, 2:] - a[:, :2]).prod(dim=-1)
    area_b = (b[:, 2:] - b[:, :2]).prod(dim=-1)
    return intersection / (area_a[:, None] + area_b[None, :] - intersection).clamp(min=1e-9)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Indices of the boxes that greedy non-maximum suppression keeps, best first: a box is dropped when it overlaps
    a better kept box by more than `iou_threshold` (torchvision.ops.nms's rule)."""
    order = scores.argsort(descending=True)
    overlaps = box_iou(boxes[order], boxes[order]) > iou_threshold
    keep = torch.ones(len(order), dtype=torch.bool, device=boxes.device)
    for index in range(len(order)):
        if keep[index]:
            keep[index + 1 :] &= ~overlaps[index, index + 1 :]
    return order[keep]


def detect(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor) -> np.ndarray:
    """One image's detections after the threshold and per-class NMS: K x 6 (left, top, right, bottom, score, class)."""
    chosen = scores > SCORE_THRESHOLD
    boxes, scores, classes = boxes[chosen], scores[chosen], classes[chosen]
    best = scores.argsort(descending=True)[:MAX_CANDIDATES]
    boxes, scores, classes = boxes[best], scores[best], classes[best]
    apart = boxes + classes[:, None].to(boxes) * (4 * SIZE)  # boxes of different classes never overlap
    kept = nms(apart, scores, IOU_THRESHOLD)[:MAX_DETECTIONS]
    found = torch.cat([boxes[kept], scores[kept, None], classes[kept, None].to(boxes)], dim=1)
    return found.cpu().numpy()


class DetectorAPI(ImageAPI):
    """Boxes, scores and classes for each upload, in the upload's own pixel coordinates."""

    name = "detector"

    def setup(self, device: str) -> None:
        torch.manual_seed(SEED)
        self.model = head().eval().to(device)
        self.device = device

    def decode_request(self, request: Request) -> np.ndarray:
        """The letterboxed uint8 SIZE x SIZE x 3 pixels; the way back in request.context."""
        image = request.open_image()
        pixels, scale, offset = letterbox(image)
        request.context.update(scale=scale, offset=offset, width=image.width, height=image.height)
        return pixels

    @torch.inference_mode()
    def predict(self, batch: np.ndarray) -> list[np.ndarray]:
        """N letterboxed images -> one K x 6 array of detections each (K differs, so a list)."""
        pixels = torch.from_numpy(batch).to(self.device).permute(0, 3, 1, 2).float()
        pixels = (pixels / 255 - 0.5) / 0.25
        boxes, scores, classes = decode_grid(self.model(pixels))
        return [detect(*item) for item in zip(boxes, scores, classes, strict=True)]

    def encode_response(self, output: np.ndarray, request: Request) -> dict[str, Any]:
        """The detections with their boxes mapped back to the upload (unpadded, unscaled, clipped to it)."""
        width, height, scale = request.context["width"], request.context["height"], request.context["scale"]
        x, y = request.context["offset"]
        boxes = (output[:, :4] - np.array([x, y, x, y], dtype=np.float32)) / scale
        boxes = boxes.clip(0, np.array([width, height, width, height], dtype=np.float32))
        visible = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        detections = [
            {"box": [round(float(v), 1) for v in box], "score": round(float(score), 4), "class": int(label)}
            for box, score, label in zip(boxes[visible], output[visible, 4], output[visible, 5], strict=True)
        ]
        return {"width": width, "height": height, "detections": detections}
