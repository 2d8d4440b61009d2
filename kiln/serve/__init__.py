"""`kiln serve`: an OpenAI-compatible HTTP server for a kiln checkpoint (chat completions with tool
calls, streaming, n, logprobs; hot weight loading for RL). See server.py for the routes."""
from kiln.serve.server import ServerHandle, serve

__all__ = ["ServerHandle", "serve"]
