"""pdctl: prefill/decode disaggregated vLLM on one multi-GPU node."""

__version__ = "0.1.0"
