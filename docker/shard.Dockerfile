# syntax=docker/dockerfile:1
# gradps shard: a slice of the parameters, their optimizer state and versions (CPU torch).
#   docker build -f docker/shard.Dockerfile -t gradps-shard .   (from the repo root)
# The CPU images share every line up to the second pip layer: one build fills the cache for all three.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
# Two pip layers: the dependencies, from pyproject.toml alone, then gradps itself. A change to the
# code rebuilds only the second, small one. torch comes from the CPU index (PyPI's Linux wheel
# carries ~3 GB of CUDA libraries); the build fails if a CUDA wheel slipped in anyway. Wheels in
# docker/wheelhouse/ (mounted for these layers alone) are found too; with
# --build-arg PIP_INDEX=--no-index they are all there is, for a build without network (README: the
# compose cluster with podman).
ARG PIP_INDEX="--extra-index-url https://download.pytorch.org/whl/cpu"
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,source=docker/wheelhouse,target=/wheelhouse \
    python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
       > /tmp/dependencies.txt \
    && pip install --find-links /wheelhouse ${PIP_INDEX} --requirement /tmp/dependencies.txt \
    && rm /tmp/dependencies.txt \
    && python -c "import torch; assert torch.version.cuda is None, 'CUDA torch in a CPU image'" \
    && groupadd --system --gid 10001 gradps \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /var/lib/gradps --shell /usr/sbin/nologin gradps

COPY gradps/ gradps/
COPY ps_server/ ps_server/
COPY gpu_worker/ gpu_worker/
COPY client/ client/
COPY docker/healthcheck.py /usr/local/bin/gradps-healthcheck
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,source=docker/wheelhouse,target=/wheelhouse \
    pip install --no-deps --find-links /wheelhouse ${PIP_INDEX} . \
    && chmod 0755 /usr/local/bin/gradps-healthcheck

# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /var/lib/gradps
# gRPC, and the data port: workers on other hosts stream payloads to it (gradps/data_stream.py).
ENV GRADPS_PORT=50052 \
    GRADPS_DATA_PORT=50053 \
    GRADPS_DEVICE=cpu
EXPOSE 50052 50053
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["gradps-healthcheck"]
ENTRYPOINT ["gradps-shard"]
