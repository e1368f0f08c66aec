import pathlib

from tests.mcp_support import fs_root, fs_server  # noqa: F401  (fixtures of the MCP tests: real servers)

ROOT = pathlib.Path(__file__).resolve().parent.parent
CATALOGS = ROOT / "fixtures" / "catalogs"


def engine_of(pipe, cfg=None, history: bool = True):
    """The engine around an already loaded pipeline (the tests load each model once)."""
    from sidecar.config import Config
    from sidecar.engine import Sidecar, open_history

    cfg = cfg or Config()
    return Sidecar(cfg, pipe, pipe.store, open_history(cfg, pipe.store) if history and pipe.store is not None else None)
