"""Benchmarks that print tables: `python -m ktlong.bench {prefill,...} --help`."""
