"""The repository's `embedder`: examples/embedding.py's EmbeddingAPI (a transformers ViT with seeded weights), served
from this folder under the folder's name (`embedder`, /v2/models/embedder: the repository's name wins over the
class's `embedding`)."""

from examples.embedding import EmbeddingAPI

__all__ = ["EmbeddingAPI"]
