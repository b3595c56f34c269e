"""gpurl: GPU-first LLM post-training in JAX."""

__version__ = "0.1.0"
