# gpurl on NVIDIA GPUs with CUDA 13. NOT BUILT IN CI: CI runs the CPU test suite
# (`make test`); build and run this image on a GPU host:
#
#   docker build -t gpurl .
#   docker run --gpus all --ipc=host -v "$PWD/runs:/opt/gpurl/runs" gpurl gpurl train
#
# The jax[cuda13] wheels bring CUDA, cuDNN and NCCL from pip; the host needs only the NVIDIA
# driver (580 or newer) and the NVIDIA Container Toolkit. --ipc=host gives NCCL the shared
# memory it needs with several GPUs. For CUDA 12 drivers, change the extra to cuda12.
FROM nvidia/cuda:13.0.2-base-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    JAX_COMPILATION_CACHE_DIR=/opt/gpurl/.jax_cache

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip git \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /opt/gpurl
# Only what the package needs (no .venv, runs/ or caches from the build context).
COPY pyproject.toml README.md ./
COPY gpurl ./gpurl
COPY configs ./configs
RUN pip install --upgrade pip && pip install -e ".[cuda13]"

CMD ["gpurl", "--help"]
