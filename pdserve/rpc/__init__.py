"""gRPC plumbing shared by every pdserve service and client, one module per concern.

- `errors`: the server interceptor that turns exceptions into statuses with a stable
  `pdserve-error-code` trailer, and `error_from_rpc` that turns them back (both read the one
  table in `pdserve.errors`, which the HTTP gateway reads too);
- `transport`: channel and server options, `new_server`, `insecure_channel`, health;
- `metadata`: `x-request-id` call metadata;
- `auth`: the cluster secret (router <-> workers) and API keys (client API) interceptors;
- `convert`: domain dataclasses <-> `pdserve.v1` messages. Only servicers and the typed
  clients (`router.clients`) use it; domain code never sees a `_pb2` message.
"""
