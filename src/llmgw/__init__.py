"""llmgw: a gateway and control plane for self-hosted LLM fleets."""

__version__ = "0.1.0"

__all__ = ["__version__"]
