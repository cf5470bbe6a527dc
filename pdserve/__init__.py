"""pdserve: disaggregated prefill/decode LLM serving.

`pdserve.v1` holds the gRPC API stubs generated from protos/pdserve/v1/ by the build;
`pdserve.grpc_util` is the one place that converts between them and `engine.types`.
"""
