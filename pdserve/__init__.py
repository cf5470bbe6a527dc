"""pdserve: disaggregated prefill/decode LLM serving.

`pdserve.v1` holds the gRPC API stubs generated from protos/pdserve/v1/ by the build;
`pdserve.rpc` holds the gRPC plumbing (errors, transport, metadata) and `pdserve.rpc.convert`
is the one place that converts between them and `engine.types`.
"""
