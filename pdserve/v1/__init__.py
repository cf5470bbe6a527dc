"""Generated gRPC stubs of the pdserve v1 API (protos/pdserve/v1/*.proto).

The *_pb2*.py modules are written by the build (`pip install -e .` or
`python setup.py build_protos`) and are not in git. Only servicers, the typed clients
(`router.clients`, `pdserve.client`) and `pdserve.rpc` import them; domain code uses
`engine.types`.
"""
