"""An OpenAI-compatible server with many bounded chats decoded together (`h2o-local serve`).

Needs the server extra: `pip install "h2o_local[server]"` (FastAPI, uvicorn, sse-starlette).
"""
from .app import create_app
from .background import serve_in_background
from .scheduler import Job, Scheduler, SessionCache

__all__ = ["create_app", "serve_in_background", "Job", "Scheduler", "SessionCache"]
