"""kvlearn: learned KV-cache compression for Hugging Face transformers models."""

from .config import KVpopConfig, StreamingConfig
from .errors import KVLearnError

__version__ = "0.1.0"

__all__ = ["KVLearnError", "KVpopConfig", "StreamingConfig", "__version__"]
