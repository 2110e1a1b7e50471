# keel's image: Python 3.11, torch==2.13.0 (the Makefile's pin) and keel with its NVML extra.
#   docker build -t keel:0.1.0 .                                         # CPU build of torch
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t keel:0.1.0-cu128 .
# The CUDA build needs no CUDA in the image (its wheels bring the runtime), only the node's NVIDIA driver.
FROM python:3.11-slim

# curl: deploy/k8s/keel-pod.sh labels a quarantined node through the Kubernetes API.
RUN apt-get update && apt-get install -y --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" torch==2.13.0

WORKDIR /keel
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir '.[gpu]'
COPY configs ./configs
COPY deploy/k8s/keel-pod.sh /usr/local/bin/keel-pod

ENV PYTHONUNBUFFERED=1
CMD ["keel", "--help"]
