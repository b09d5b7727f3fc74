"""An OpenAI-compatible server with many bounded chats decoded together (`h2o-local serve`).

Needs the server extra: `pip install "h2o_local[server]"` (FastAPI, uvicorn, sse-starlette).
"""
from .app import create_app
from .scheduler import Job, Scheduler, SessionCache

__all__ = ["create_app", "Job", "Scheduler", "SessionCache"]
