"""Prefill worker: computes prompt KV and writes it into a decode worker's blocks over UCX."""
