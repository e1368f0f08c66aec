import pathlib

from tests.mcp_support import fs_root, fs_server  # noqa: F401  (fixtures of the MCP tests: real servers)

ROOT = pathlib.Path(__file__).resolve().parent.parent
CATALOGS = ROOT / "fixtures" / "catalogs"
