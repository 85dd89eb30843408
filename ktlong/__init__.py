"""ktlong: long-context LLM inference on one GPU plus host memory."""

__version__ = "0.1.0"
