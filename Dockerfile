# One image for every specserve process (draft-server, target-server, orchestrator).
# CPU torch by default; for GPUs build with --build-arg TORCH_INDEX=<a CUDA wheel index>.
FROM python:3.11-slim
ARG TORCH_INDEX=""
RUN apt-get update && apt-get install -y --no-install-recommends g++ ninja-build \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specserve ./specserve
RUN if [ -n "$TORCH_INDEX" ]; then pip install --no-cache-dir torch --index-url "$TORCH_INDEX"; fi \
    && pip install --no-cache-dir ".[tp]"
RUN useradd --create-home specserve && mkdir /models && chown specserve /models
USER specserve
ENV SPECSERVE_HOME=/models SPECSERVE_HOST=0.0.0.0 PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["specserve", "--help"]
