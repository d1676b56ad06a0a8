"""llmgw's stand-in for the ``tensorrt_llm`` package: only its version (for ``llmgw ctl engine-check trtllm``)."""

__version__ = "0.0.0+llmgw.standin"
print(f"[TensorRT-LLM] TensorRT-LLM version: {__version__}")
