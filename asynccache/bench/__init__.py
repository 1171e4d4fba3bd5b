"""Benchmarks behind ``asynccache bench NAME`` (one module each; results go to docs/benchmarks.md)."""
