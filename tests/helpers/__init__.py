"""What several test modules share and that is no fixture of `tests/conftest.py`: the cluster
fixture factory and clients of a running cluster (`cluster_util`), engine drivers
(`engine_util`), a real redis-server (`redis_server`), a veth network namespace for fault
tests (`netfault`), a server on a private event loop (`loop_thread`), hypothesis strategies
for protobuf messages (`protobuf_strategies`), a tokenizer that can be held
(`gated_tokenizer`) and a same-host KV peer run as a child process
(`python -m tests.helpers.kv_shm_peer`)."""
