"""Export of saved quantized models to other runtimes' file formats (GGUF for llama.cpp / ollama)."""
