"""`tokenmind serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine.

`run_server(ServeConfig(model="smollm2"))` serves `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`, `/metrics` and a web chat page at `/`; `build_app(config)` returns the
ASGI app alone, to mount or test. A diffusion run is served by `build_image_app(config)` instead:
`/v1/images/generations` and an image page. A vision-language model's directory (`save_vlm`) is
served by the chat app, whose messages may then hold images (`vision.py`).
"""

from .app import build_app
from .config import ServeConfig
from .images import build_image_app
from .server import run_server

__all__ = ["ServeConfig", "build_app", "build_image_app", "run_server"]
