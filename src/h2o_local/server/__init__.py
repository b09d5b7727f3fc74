"""An OpenAI-compatible server with many bounded chats decoded together (`h2o-local serve`).

Needs the server extra: `pip install "h2o_local[server]"` (FastAPI, uvicorn, sse-starlette, pydantic-settings).
Layout: `settings` (ServerSettings: every option, once), `protocol` (request models, errors), `requests` (a
request translated into engine values: sampling, its own policy and recall, limits), `state` (what the routes share),
`routes` (the module-level router: the handlers), `scheduler` (the decoding thread, saved sessions), `app`
(create_app puts them together).
"""
from .app import create_app
from .background import serve_in_background
from .routes import router
from .scheduler import Job, Scheduler, SessionCache
from .settings import ServerSettings

__all__ = ["create_app", "serve_in_background", "router", "Job", "Scheduler", "ServerSettings", "SessionCache"]
