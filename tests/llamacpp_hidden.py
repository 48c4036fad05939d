"""Worker run by the tests in the optional llama.cpp venv (xllamacpp): the final-norm hidden states [T, hidden] of a
GGUF model on token ids, printed as JSON. Usage: llamacpp_hidden.py MODEL.gguf '[ids]'."""

import json
import sys
import urllib.request

import xllamacpp as xlc

gguf_file, ids = sys.argv[1], json.loads(sys.argv[2])
params = xlc.CommonParams()
params.model.path = gguf_file
params.n_parallel = 1
params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 1
params.n_ctx = params.n_batch = params.n_ubatch = len(ids)
params.embedding, params.warmup = True, False
params.pooling_type = xlc.llama_pooling_type.LLAMA_POOLING_TYPE_NONE
server = xlc.Server(params)
request = urllib.request.Request(server.listening_address + "/embedding", data=json.dumps({"content": ids}).encode(),
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=600) as reply:
    print(json.dumps(json.loads(reply.read())[0]["embedding"]))
