# syntax=docker/dockerfile:1
# gradps shard on an NVIDIA GPU: its parts, optimizer state and updates live in CUDA memory.
#   docker build -f docker/shard.cuda.Dockerfile -t gradps-shard-cuda .   (from the repo root)
# Needs the NVIDIA Container Toolkit on the host (docker run --gpus all, or docker-compose.gpu.yml).
#
# torch's CUDA wheel brings its own CUDA libraries as pip packages, so the `base` flavour of
# nvidia/cuda (cudart, and the NVIDIA_* variables the container toolkit reads) is enough: `runtime`
# would add ~2 GB of second copies. CUDA 13.0 matches torch 2.13's wheels (host driver >= 580);
# for an older driver build with
#   --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu22.04 --build-arg TORCH_CUDA=cu128
# Ubuntu 22.04 is the newest nvidia/cuda base whose archive packages Python 3.11.
# The CUDA images share every line up to the second pip layer: one build fills the cache for both.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu22.04
FROM ${CUDA_IMAGE}
ARG TORCH_CUDA=cu130
ARG DEBIAN_FRONTEND=noninteractive

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PATH=/opt/venv/bin:$PATH

# Distribution Python, unpinned on purpose: the CUDA tag pins the Ubuntu release, apt brings its fixes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv

WORKDIR /src
# Two pip layers: the dependencies, from pyproject.toml alone, then gradps itself (a change to the
# code rebuilds only the second, small one). The build fails if pip resolved a CPU-only torch.
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
       > /tmp/dependencies.txt \
    && pip install --extra-index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" --requirement /tmp/dependencies.txt \
    && rm /tmp/dependencies.txt \
    && python -c "import torch; assert torch.version.cuda, 'CPU-only torch in a CUDA image'" \
    && groupadd --system --gid 10001 gradps \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /var/lib/gradps --shell /usr/sbin/nologin gradps

COPY gradps/ gradps/
COPY ps_server/ ps_server/
COPY gpu_worker/ gpu_worker/
COPY client/ client/
COPY docker/healthcheck.py /usr/local/bin/gradps-healthcheck
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps . \
    && chmod 0755 /usr/local/bin/gradps-healthcheck

# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /var/lib/gradps
# gRPC, and the data port: workers on other hosts stream payloads to it (gradps/data_stream.py).
ENV GRADPS_PORT=50052 \
    GRADPS_DATA_PORT=50053 \
    GRADPS_DEVICE=cuda
EXPOSE 50052 50053
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["gradps-healthcheck"]
ENTRYPOINT ["gradps-shard"]
