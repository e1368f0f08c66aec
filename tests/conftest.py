import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CATALOGS = ROOT / "fixtures" / "catalogs"
