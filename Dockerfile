# syntax=docker/dockerfile:1
# One image per variant for every specserve process (draft-server, target-server,
# orchestrator, models fetch). Build through scripts/build-images.sh, which names the
# tags the manifests run: <repo>:<version>-cpu and <repo>:<version>-cuda.
#
#   VARIANT=cpu   torch from the PyTorch CPU wheel index (TORCH_INDEX; pass yours)
#   VARIANT=cuda  torch from the default index (its Linux x86-64 wheels are CUDA builds)
#
# Layers from least to most often changed: base, torch (pinned), the other dependencies
# (from pyproject.toml alone), the source, the prebuilt kernels. The runtime stage has
# no compiler: the CPU kernels are built here for AVX-512 and AVX2.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=""
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN if [ -n "$TORCH_INDEX" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi
WORKDIR /src
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}"
COPY README.md ./
COPY specserve ./specserve
RUN pip install --no-deps . && python -m compileall -q /opt/venv/lib
# Built at the path the pods use (/tmp is their writable emptyDir): torch's JIT cache
# then finds the libraries up to date there and needs no compiler.
ENV TORCH_EXTENSIONS_DIR=/tmp/torch-extensions
RUN python -m specserve.engine.kernel_prebuild

FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.source="https://github.com/specserve/specserve" \
      org.opencontainers.image.description="specserve (${VARIANT})"
# Runtime libraries only: the kernels link libgomp (OpenMP) and libstdc++.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 libstdc++6 \
    && rm -rf /var/lib/apt/lists/*
# A numeric user, so runAsNonRoot can be verified by the kubelet.
RUN groupadd --gid 10001 specserve \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp specserve \
    && mkdir /models && chown 10001:10001 /models
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder --chown=10001:10001 /tmp/torch-extensions /opt/specserve/torch-extensions
# HOME and the JIT cache on /tmp: the pods mount the root filesystem read-only.
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    TORCH_EXTENSIONS_DIR=/tmp/torch-extensions \
    SPECSERVE_HOME=/models \
    SPECSERVE_HOST=0.0.0.0 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
ENTRYPOINT []
CMD ["specserve", "--help"]
