# The pdserve image: the `pdserve` CLI (router, prefill and decode workers) with the default
# model converted and cached at build time, so containers start without network access.
# CPU build; docker-compose.yml runs one container per process.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache \
    HF_HUB_OFFLINE=1 \
    UCX_WARN_UNUSED_ENV_VARS=n

# torch first, from the CPU index: the project pins the version, this picks the CPU build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /src
COPY . .
# Builds the gRPC stubs from protos/ (setup.py) and installs the `pdserve` command.
RUN pip install . && rm -rf /src

# Download and convert the default model into $PDSERVE_CACHE_DIR (read-only from here on).
RUN pdserve model pull

RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin pdserve
USER pdserve
WORKDIR /tmp

# Router: HTTP gateway and gRPC API. Worker ports are chosen in docker-compose.yml.
EXPOSE 8000 50051
CMD ["pdserve", "--help"]
