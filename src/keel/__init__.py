"""keel: LLM pre-training built to production standards, from one CPU process to thousands of GPUs."""

__version__ = "0.1.0"
