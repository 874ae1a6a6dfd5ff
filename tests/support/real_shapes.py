"""Models of the shapes users bring (torchvision cannot be imported here): each mirrors a real architecture's
input contract and output type, with random weights, and is served by `--model-factory real_shapes:<Name>`."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

CLASSES = 10
SEGMENT_CLASSES = 21  # PASCAL VOC's, as torchvision's segmentation weights


class FixedSizeClassifier(nn.Module):
    """A ResNet-like CNN that, like an exported program with static shapes, accepts only 224 x 224 input."""

    def __init__(self, size: int = 224) -> None:
        super().__init__()
        self.size = size
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 7, stride=2, padding=3), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.size, self.size):
            raise ValueError(f"expected {self.size}x{self.size} input, got {tuple(x.shape[-2:])}")
        features = self.stem(x)
        features = F.relu(features + self.block(features))
        return self.head(features.mean(dim=(2, 3)))


class Probabilities(FixedSizeClassifier):
    """A classifier that ends in a softmax: served with --scores probabilities."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).softmax(dim=1)


class PatchTransformer(nn.Module):
    """ViT-style: 16 x 16 patch-embedding conv, a class token, position embeddings, one encoder layer, a head."""

    def __init__(self, size: int = 224, patch: int = 16, dim: int = 32) -> None:
        super().__init__()
        self.size = size
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.class_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.position = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)
        self.encoder = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=64, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.shape[2] == self.size, f"Wrong image height! Expected {self.size} but got {x.shape[2]}!")
        torch._assert(x.shape[3] == self.size, f"Wrong image width! Expected {self.size} but got {x.shape[3]}!")
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.class_token.expand(x.shape[0], -1, -1), tokens], dim=1) + self.position
        return self.head(self.norm(self.encoder(tokens))[:, 0])


class DictSegmenter(nn.Module):
    """FCN/DeepLab-style: a stride-4 backbone, per-class logits upsampled to the input size, as {"out", "aux"}."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.ReLU()
        )
        self.classifier = nn.Conv2d(16, SEGMENT_CLASSES, 1)
        self.aux = nn.Conv2d(16, SEGMENT_CLASSES, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.backbone(x)
        size = x.shape[-2:]
        return {
            "out": F.interpolate(self.classifier(features), size=size, mode="bilinear", align_corners=False),
            "aux": F.interpolate(self.aux(features), size=size, mode="bilinear", align_corners=False),
        }


class ListDetector(nn.Module):
    """Faster R-CNN-style output: a list of {"boxes" (x1, y1, x2, y2 in the input's pixels), "labels", "scores"}.

    Deterministic: one candidate box per quadrant of the image, scored and labelled from its mean colour.
    """

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(3, 1)
        self.label = nn.Linear(3, CLASSES)

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        height, width = x.shape[-2:]
        results = []
        for image in x:
            boxes, colours = [], []
            for top, bottom in ((0, height // 2), (height // 2, height)):
                for left, right in ((0, width // 2), (width // 2, width)):
                    boxes.append(torch.tensor([left + 1.5, top + 0.5, right - 0.25, bottom - 1.0]))
                    colours.append(image[:, top:bottom, left:right].mean(dim=(1, 2)))
            features = torch.stack(colours)
            scores = torch.sigmoid(self.score(features)[:, 0] * 4)
            order = scores.argsort(descending=True)
            labels = self.label(features).argmax(dim=1) + 1  # 0 is the background, as in torchvision
            results.append({"boxes": torch.stack(boxes)[order], "labels": labels[order], "scores": scores[order]})
        return results


class RGBAOutput(nn.Module):
    """A matting-style model: the image plus a predicted alpha channel, N x 4 x H x W in [0, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Conv2d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.sigmoid(self.alpha(x) * 4)], dim=1)


class ThreeClassSegmenter(nn.Module):
    """Three per-pixel classes: the same shape as an RGB image, so it needs --task segment."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x)


class Unservable(nn.Module):
    """Returns N x 3 x 5: neither images, scores, masks nor detections."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))[:, :, None].expand(-1, -1, 5) * self.gain
