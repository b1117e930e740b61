"""Benchmarks: scripts that write JSON, Markdown and PNG under results/. Never timed tests."""
