# The pdserve image (CPU): the `pdserve` CLI (router, prefill and decode workers) with the
# default model converted and the fused CPU kernels built at image build time, so containers
# start without network access. docker-compose.yml runs one container per process; the GPU
# variant is Dockerfile.cuda.
#
# Layers go from least to most often changed: torch, then the dependencies (read from
# pyproject.toml alone), then the source. Editing code rebuilds only the last layers.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache \
    HF_HOME=/opt/pdserve/cache/huggingface \
    HF_HUB_OFFLINE=1 \
    UCX_WARN_UNUSED_ENV_VARS=n

# The runtime user owns the cache (models, converted GGUFs, compiled kernels, HF cache), so a
# GGUF mounted at run time can be converted into it. Its home holds torch's extension cache.
RUN useradd --system --uid 10001 --create-home --home-dir /home/pdserve \
        --shell /usr/sbin/nologin pdserve \
    && mkdir -p /opt/pdserve/cache && chown -R pdserve:pdserve /opt/pdserve

# torch first, from the CPU index: pyproject.toml gives a range, this picks the tested CPU
# build (the same version the Makefile installs).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /src
# Dependencies only: this layer is rebuilt when pyproject.toml changes, not when code does.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "grpcio-tools==1.85.*" "setuptools>=68" wheel \
    && rm /tmp/requirements.txt

# Then the source: the build generates the gRPC stubs from protos/ (setup.py).
COPY setup.py MANIFEST.in README.md ./
COPY protos ./protos
COPY pdserve ./pdserve
COPY router ./router
COPY prefill_svc ./prefill_svc
COPY decode_svc ./decode_svc
COPY kvxfer ./kvxfer
RUN pip install --no-deps --no-build-isolation . && rm -rf /src

USER pdserve
WORKDIR /home/pdserve
# Download and convert the default model, and build the CPU kernels, as the runtime user.
RUN pdserve model pull

# Router: HTTP gateway and gRPC API; workers: gRPC and metrics (ports set in compose / k8s).
# Health: `pdserve health --http URL` (router) or `--grpc HOST:PORT` (workers), set per
# service in docker-compose.yml; Kubernetes probes gRPC health natively (deploy/).
EXPOSE 8000 50051
CMD ["pdserve", "--help"]
