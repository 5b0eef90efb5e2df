"""OpenAI-compatible HTTP server (``sluice serve``), built on the public engine API.

Needs the ``server`` extra (FastAPI, uvicorn, pydantic). Importing this package imports
none of them; ``serve_command`` checks for them first and says how to install them. The
library (``sluice``) never imports this package.
"""

from __future__ import annotations

import importlib.util

from ..errors import SluiceError

REQUIRED = ("fastapi", "uvicorn", "pydantic")


def missing_dependencies() -> list[str]:
    return [m for m in REQUIRED if importlib.util.find_spec(m) is None]


def require_dependencies(command: str = "sluice serve") -> None:
    missing = missing_dependencies()
    if missing:
        raise SluiceError(f"{command} needs {', '.join(missing)}, which are not installed: "
                          "pip install 'sluice[server]'")


def serve_command(args, engine_options: dict) -> int:
    """``sluice serve``: load the model, then serve it until interrupted."""
    import sys

    from .bind import bind, check_api_key

    args.api_key = check_api_key(args.api_key)
    require_dependencies()
    sock = bind(args.host, args.port)  # before loading: a port in use fails at once, nothing announced
    try:
        from .. import load
        from .app import serve
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"sluice: warning: serving on {args.host} without --api-key: anyone who can reach this port "
              "can use the model", file=sys.stderr)
    try:
        engine = load(args.model, memory=args.memory, revision=args.revision, **engine_options)
    except BaseException:
        sock.close()
        raise
    name = args.model_name or engine.model_id
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"sluice: serving '{name}' on http://{host}:{port}/v1 (context {engine.max_context} tokens, "
          f"queue {args.max_queue})", file=sys.stderr)
    print(f"sluice: chat in a browser at http://{host}:{port}/", file=sys.stderr)
    try:
        serve(engine, host=args.host, port=port, model_name=name, api_key=args.api_key,
              max_queue=args.max_queue, max_body_bytes=args.max_body, log_level=args.log_level, sock=sock)
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised Ctrl-C
        pass
    finally:
        sock.close()
        engine.close()
    print("sluice: server stopped", file=sys.stderr)
    return 0
