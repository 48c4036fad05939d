"""The quantization pipeline: a recipe becomes a list of stages that the engine walks (`engine`), the LM head in low
bits (`head`), resumable progress (`resume`). The stages themselves are registered pieces (`bitquilt.stages`,
`transforms`, `policies`)."""
