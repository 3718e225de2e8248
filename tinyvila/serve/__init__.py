"""tinyvila.serve: an OpenAI-compatible HTTP server and a web chat page (`python -m tinyvila.serve`).

    pip install -e ".[serve]"
    python -m tinyvila.serve --model vila-8b-awq            # http://127.0.0.1:8000, API under /v1

An optional front end over the Python API, like convert/: `protocol.py` (requests and responses), `media.py`
(content parts, decoded off the worker), `engine.py` (the one worker, its FIFO queue and the prefix-reuse LRU),
`metrics.py` (/metrics), `app.py` (the Starlette routes), `static/index.html` (the page). In-process use:
`create_app(Engine(tinyvila.load(...)), model_name=...)` from `tinyvila.serve.app` is an ASGI app. docs/serve.md.
"""
