"""`hybridpar serve`: validate the options and the model source before starting anything, start the
replicas, then answer HTTP on 127.0.0.1 (by default) until interrupted."""

from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path

from hybridpar.serve.config import ServeConfig, help_text, parse_serve_args

USAGE = """usage: hybridpar serve [--source PATH|init:SEED] [--tp N --pp N --dp N] [--port P] [--strategy S] ...

Serves a model over an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models), /health
and /metrics.
"""


def prepare(argv: list[str]) -> tuple[ServeConfig, "object", str]:
    """(config, model config, resolved source) or ValueError."""
    from hybridpar.serve.worker import resolve_source

    cfg, model = parse_serve_args(argv)
    # `model` (the training defaults plus any --model.* flags) is used by init:SEED only: every other
    # source carries its shape (config.json, or a checkpoint's trainer_state.json).
    source, model_cfg = resolve_source(cfg.source, model)
    cfg.validate(model_cfg)
    if (Path(source) / "config.json").is_file():
        # Every tensor there in the shape config.json gives (headers only): a config.json beside another
        # model's weights is one line here, not a traceback from each worker after the replicas start.
        from hybridpar.model.hf import SafetensorsDir
        from hybridpar.model.registry import check_hf_tensors

        try:
            check_hf_tensors(model_cfg, SafetensorsDir(source))
        except ValueError as e:
            why = f"model source {source!r} does not hold the model its config.json describes: {e}"
            raise ValueError(why) from None
    return cfg, model_cfg, source


def reserve_port(host: str, port: int) -> None:
    """ValueError if (host, port) cannot be bound: said before the replicas load (minutes for a large
    model), where binding only once they are up would say it after. The server binds it again then."""
    if port == 0:
        return
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's socket: TIME_WAIT is no bar
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"cannot bind {host}:{port}: {e} (--port another, or 0 for any free port)") from None


def tokenizer_for(cfg: ServeConfig, model: "object", source: str) -> "object | None":
    """The tokenizer to serve with: --tokenizer, else the source's own (a model directory's
    tokenizer.json, a checkpoint's data.tokenizer), else None. ValueError if its ids do not fit the model."""
    import json

    from hybridpar.data.tokenizer import TOKENIZER_FILE, Tokenizer

    path = cfg.tokenizer or None
    src = Path(source)
    if path is None and (src / TOKENIZER_FILE).is_file():
        path = str(src)
    elif path is None and (src / "trainer_state.json").is_file():
        path = json.loads((src / "trainer_state.json").read_text(encoding="utf-8"))["config"]["data"].get("tokenizer")
    if path is None:
        return None
    tok = Tokenizer(path)
    if tok.vocab_size > model.vocab_size:
        raise ValueError(f"serve tokenizer {path!r} has {tok.vocab_size} ids, the model only {model.vocab_size}")
    return tok


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the server the way Ctrl-C does: through the cleanup below


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n" + help_text())
        return 0
    try:
        cfg, model_cfg, source = prepare(argv)
        tokenizer = tokenizer_for(cfg, model_cfg, source)
        reserve_port(cfg.host, cfg.port)
        if importlib.util.find_spec("prometheus_client") is None:  # /metrics is written with it
            raise ValueError("hybridpar serve needs prometheus_client: pip install 'hybridpar[serve]'")
    except ValueError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    from hybridpar.serve.http import make_server
    from hybridpar.serve.server import HttpServer
    from hybridpar.serve.service import Service

    # Before the first worker starts: a SIGTERM while the replicas start must still stop them (the pool
    # kills its workers when its start is interrupted; each worker also dies with this process, see
    # topology/lifetime.py).
    previous = signal.signal(signal.SIGTERM, _stop)
    svc: Service | None = None
    srv: HttpServer | None = None
    try:
        try:
            svc = Service(cfg, model_cfg, source, tokenizer=tokenizer)
        except RuntimeError as e:  # a replica did not start (its worker's error is on stderr above)
            print(f"hybridpar: error: {e}", file=sys.stderr)
            return 1
        try:  # bound once the replicas are up, so no client meets a half-started server
            srv = make_server(svc, cfg.host, cfg.port)
        except OSError as e:
            print(f"hybridpar: error: cannot bind {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
            return 2
        host, port = srv.server_address[:2]
        print(
            f"hybridpar: serving {cfg.model_name!r} from {source} ({cfg.dp} replica(s) of tp={cfg.tp} x pp={cfg.pp}) "
            f"on http://{host}:{port}/v1",
            flush=True,
        )
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup is bounded (pool.close): let it finish
        try:
            if srv is not None:
                srv.server_close()
            if svc is not None:
                svc.close()
        finally:
            signal.signal(signal.SIGTERM, previous)
    return 0
