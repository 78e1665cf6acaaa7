"""The stepscope dashboard: a Streamlit page that speaks only docs/protocol.md to an engine server.

Nothing in this package imports torch or the engine: the page can watch an engine anywhere.
"""
