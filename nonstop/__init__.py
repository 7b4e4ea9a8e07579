"""nonstop: JAX-native post-training for LLMs and tool-using agents."""

__version__ = "0.1.0"
