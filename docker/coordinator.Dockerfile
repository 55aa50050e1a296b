# syntax=docker/dockerfile:1
# gradps coordinator: runs, membership, placement, metrics. Holds no tensors, so CPU only.
#   docker build -f docker/coordinator.Dockerfile -t gradps-coordinator .   (from the repo root)
# The CPU images share every line up to the pip layer: one build fills the cache for all three.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
COPY pyproject.toml ./
COPY gradps/ gradps/
COPY ps_server/ ps_server/
COPY gpu_worker/ gpu_worker/
COPY client/ client/
COPY docker/healthcheck.py /usr/local/bin/gradps-healthcheck

# One pip layer. torch comes from the CPU index (PyPI's Linux wheel carries ~3 GB of CUDA libraries);
# the build fails if a CUDA wheel slipped in anyway. Wheels in docker/wheelhouse/ (mounted for this
# layer alone) are found too; with --build-arg PIP_INDEX=--no-index they are all there is, for a
# build without network (README: the compose cluster with podman).
ARG PIP_INDEX="--extra-index-url https://download.pytorch.org/whl/cpu"
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,source=docker/wheelhouse,target=/wheelhouse \
    pip install --find-links /wheelhouse ${PIP_INDEX} . \
    && python -c "import torch; assert torch.version.cuda is None, 'CUDA torch in a CPU image'" \
    && chmod 0755 /usr/local/bin/gradps-healthcheck \
    && groupadd --system --gid 10001 gradps \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /var/lib/gradps --shell /usr/sbin/nologin gradps

# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /var/lib/gradps
ENV GRADPS_PORT=50051
EXPOSE 50051
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["gradps-healthcheck"]
ENTRYPOINT ["gradps-coordinator"]
