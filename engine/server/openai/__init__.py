"""The OpenAI-compatible HTTP API in the API process: the engine glue and its router (api.py),
the Starlette web app (app.py), the request models (schema.py) and the response bodies
(response.py). SGLang's worker routes (engine/server/sglang) are mounted on the same app."""
