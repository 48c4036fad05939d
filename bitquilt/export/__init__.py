"""Export of saved quantized models to other runtimes' formats: GGUF (llama.cpp / ollama), compressed-tensors
(vLLM / transformers) and standalone (bitquilt's own runtime without torch, `bitquilt.runtime.standalone`)."""

FORMATS = ("gguf", "compressed-tensors", "standalone")  # `bitquilt export --to`
