"""`draftrelay serve`: an OpenAI-compatible HTTP front for the engine.

    protocol.py   request bodies -> validated generation requests (400 naming the field)
    chat.py       chat templates (jinja2, rendered as transformers renders them)
    textstream.py token ids -> text deltas: incremental detokenization and stop strings
    scheduler.py  the engine's step loop on one thread: continuous batching, cancellation
    metrics.py    Prometheus metrics (vLLM's names under this project's prefix) + hand-off counters
    app.py        the FastAPI application: endpoints, SSE streaming, API key
    cli.py        the subcommand: load models, start the local worker, warm up, run uvicorn
"""
