"""SGLang's worker API (worker.py): the routes SGLang's Model Gateway calls, so that stepscope
replicas sit behind it as SGLang servers do (python -m engine.server.fleet)."""
