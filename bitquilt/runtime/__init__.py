"""Everything that turns a quantized model into tokens, from the transformers model to a C++ program.

The ladder, slowest and most general first (docs/runtime.md says why each rung exists):

- `engines`: the one place that picks how a torch model generates ("transformers", "lean", "fused" or "auto");
- `module_tree`: bitquilt's own torch module tree for a saved model (`--runtime bitquilt`), no transformers import;
- `lean`: `LeanDecoder`, batch-1 decoding with a static KV cache over the model's own modules (`LeanLayers`: the
  same over several sequences' caches);
- `batch`: continuous batching, sequences joining and leaving a running batch between steps (`bitquilt serve`);
- `fused`: every decoder layer of a one-token step in one call of the C++ extension;
- `standalone`: the torch-free runtime of a standalone export (`bitquilt-run`; its own continuous batch for
  `bitquilt serve`), and `bitquilt-native`, the same model from a C++ program;
- `loop`: the decode loop all of them share; `tokenizer`: a tokenizer.json run by the `tokenizers` library alone.

This package imports nothing on import (the standalone runtime must run without torch), and no calibration or
algorithm code at all.
"""
