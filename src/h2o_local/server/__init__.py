"""An OpenAI-compatible server with many bounded chats decoded together (`h2o-local serve`).

Needs the server extra: `pip install "h2o_local[server]"` (FastAPI, uvicorn, sse-starlette, pydantic-settings).
Layout: `settings` (ServerSettings: every option, once), `protocol` (request models, errors), `requests` (a
request translated into engine values: sampling, its own policy and recall, limits), `state` (what the routes share),
`answers` (what every route module shares: a request made a job, submitted, answered whole or streamed), one route
module per API dialect (`routes`: OpenAI's and llama-server's handlers on the module-level router; `ollama`,
`anthropic_messages`, `openai_responses`, `embeddings`), `scheduler` (the decoding thread, saved sessions), `app`
(create_app puts them together).
"""
from .app import create_app
from .background import serve_in_background
from .routes import router
from .scheduler import Job, JobProgress, JobRequest, Scheduler, SessionCache
from .settings import ServerSettings

__all__ = ["create_app", "serve_in_background", "router", "Job", "JobProgress", "JobRequest", "Scheduler", "ServerSettings", "SessionCache"]
