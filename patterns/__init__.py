"""The gate's built-in pattern files (lists.txt, negative.txt, high.txt), installed as the
package data `sidecar.builtin_patterns`; `sidecar.core.patterns.load_dir()` reads them."""
