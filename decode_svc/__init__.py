"""Decode worker: continuous batching over a paged KV cache; accepts remotely prefilled KV."""
