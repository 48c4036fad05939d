"""`bitquilt serve`: an OpenAI-compatible HTTP server for a saved or packaged model, or a standalone export
(docs/serve.md).

- `protocol`: requests checked field by field, OpenAI's answer, chunk and error shapes;
- `chat`: the model's chat template, rendered in Jinja's immutable sandbox;
- `text`: new tokens' text released as it becomes final, cut at stop strings;
- `worker`: the asyncio queue, the running batch (`bitquilt.runtime.batch`, or
  `bitquilt.runtime.standalone.batch` for an export) and its decode thread;
- `elastic`: elastic mode's controller, the bits that keep each stream at a target decode speed;
- `app`: the Starlette routes, the API key and the limits.

Needs the `serve` extra (starlette, uvicorn); imports nothing on import.
"""
