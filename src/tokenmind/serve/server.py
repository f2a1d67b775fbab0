"""`run_server`: load the model, build the app, and serve it with uvicorn until SIGINT/SIGTERM.

Shutdown is graceful: on the first signal uvicorn stops accepting connections and waits for the
open ones; we also stop admitting requests (503) and give the running ones `shutdown_timeout`
seconds to finish, then abort them, so every stream still ends with a finish reason and
`data: [DONE]` rather than a cut connection. The process then exits with status 0 (uvicorn's
default of re-raising the signal would kill it with SIGTERM's status instead). A second Ctrl-C
forces the exit. If the engine fails, the server shuts down the same way and `run_server`
returns 1, so a supervisor (systemd, Kubernetes, a shell loop) restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import uvicorn

from ..diffusion.train import diffusion_model_dir
from ..model.load import Pretrained
from .app import build_app
from .config import ServeConfig
from .images import build_image_app

log = logging.getLogger("tokenmind.serve")


class GracefulServer(uvicorn.Server):
    """uvicorn's server, telling the app when a shutdown signal arrives and exiting 0 afterwards."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: object) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            self.on_exit()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def warn_if_exposed(config: ServeConfig) -> None:
    """Shout when the model is reachable from other machines, louder still without an API key."""
    if not config.is_public:
        return
    if config.api_key is None and config.trusted_hosts() is not None:
        log.warning("listening on %s without an API key: only requests whose Host header names %s are answered; "
                    "pass --allowed-hosts NAME[,NAME] with the names clients use, or an --api-key",
                    config.host, ", ".join(config.trusted_hosts()))
    elif config.api_key is None:
        log.warning("!" * 78)
        log.warning("listening on %s WITHOUT an API key: anyone who can reach this machine on port %d can use "
                    "the model. Pass --api-key, or bind --host 127.0.0.1.", config.host, config.port)
        log.warning("!" * 78)
    else:
        log.warning("listening on %s: reachable from other machines (API key required)", config.host)


def uvicorn_server(config: ServeConfig, pretrained: Pretrained | None = None) -> uvicorn.Server:
    """A ready-to-run uvicorn server for the app (`.run()` blocks; tests run it on a thread): the image
    app when `config.model` is a diffusion run, else the chat app."""
    if pretrained is None and diffusion_model_dir(config.model) is not None:
        app = build_image_app(config)
    else:
        app = build_app(config, pretrained)
    service = app.state.service
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               timeout_graceful_shutdown=config.shutdown_timeout + 5.0, access_log=False)
    server = GracefulServer(uv_config, on_exit=service.begin_shutdown)
    service.request_exit = lambda: setattr(server, "should_exit", True)
    return server


def run_server(config: ServeConfig, pretrained: Pretrained | None = None) -> int:
    """Serve until SIGINT/SIGTERM (exit status 0) or an engine failure (1), shutting down gracefully.

    `pretrained` skips loading `config.model`."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s: %(message)s", stream=sys.stderr)
    warn_if_exposed(config)
    server = uvicorn_server(config, pretrained)
    log.info("OpenAI API on http://%s:%d/v1, chat page on http://%s:%d/", config.host, config.port, config.host,
             config.port)
    server.run()
    return server.config.app.state.service.exit_code
