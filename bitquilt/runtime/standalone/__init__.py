"""The standalone runtime: a quantized model run with the `tokenizers` library and a small C library, no torch or numpy.

`bitquilt export SAVED -o OUT --to standalone` (`bitquilt.export.standalone`, in the torch process) writes the
kernel layouts themselves into one safetensors file; this package maps it and runs it:

    bitquilt-run OUT --prompt "The capital of France is"          # command line (bitquilt.runtime.standalone.cli)
    bitquilt-native OUT --prompt "The capital of France is"       # the same from a C++ program, no Python
    bitquilt serve OUT                                             # over HTTP, continuously batched (batch.py)

    from bitquilt.runtime.standalone.model import StandaloneModel          # Python
    from bitquilt.runtime.standalone.generate import generate
    print(generate(StandaloneModel("OUT"), "The capital of France is", max_new_tokens=16).text)

Why: importing torch costs ≈ 220 MB of resident memory before any weight, more than a small 4-bit model, and a
torch runtime repacks the saved weights into kernel layouts at load. Here the process is the interpreter, the
tokenizer and the weights' pages. What runs: the 4/2-bit × int8 and 8-bit × int8 kernels and the fused layer
math of the torch extension's decode step, built from the same sources (csrc/: q4_int8, uniform8_gemv,
decoder_core.h) into a library of their own (`bitquilt.runtime.standalone.library`), a prompt as one batched pass.
Nothing in this package imports torch or numpy (tested). `bitquilt-native` (`bitquilt.runtime.standalone.program`)
goes one step further: the same library's loader and kernels with a C++ front end and the export's own tokenizer
tables (csrc/runtime/native_runner.cpp, csrc/text/bpe_tokenizer.cpp), so that the process is the program and the
weights' pages.
"""
