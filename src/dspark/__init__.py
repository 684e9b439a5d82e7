"""dspark — confidence-scheduled speculative decoding."""

__version__ = "0.1.0"
