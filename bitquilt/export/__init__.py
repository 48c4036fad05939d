"""Export of saved quantized models to other runtimes' formats: GGUF (llama.cpp / ollama) and compressed-tensors
(vLLM / transformers)."""

FORMATS = ("gguf", "compressed-tensors")  # `bitquilt export --to`
