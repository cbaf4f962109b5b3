# One image for all three services; docker-compose.yml picks the command.
FROM python:3.11-slim

# PyPI's default torch is a multi-GB CUDA build. Point pip at a CPU (or CUDA) build:
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# or put a wheel into ./wheels (the build copies it) and leave TORCH_INDEX_URL empty.
ARG TORCH_INDEX_URL=""
WORKDIR /app
COPY wheels/ /wheels/
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY specdec/ specdec/
COPY verifier_svc/ verifier_svc/
COPY drafter_svc/ drafter_svc/
COPY gateway/ gateway/
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
      python3 -m pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" torch==2.13.0; \
    else \
      python3 -m pip install --no-cache-dir --find-links /wheels torch==2.13.0; \
    fi \
 && python3 -m pip install --no-cache-dir --find-links /wheels . \
 && rm -rf /wheels

# The default model is fetched and converted once into this volume.
ENV SPECDEC_CACHE_DIR=/cache
VOLUME /cache
