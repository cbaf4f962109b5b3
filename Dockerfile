# One image for all three services; docker-compose.yml picks the command.
# Needs BuildKit (the default builder since Docker 23; `docker compose build` uses it).
FROM python:3.11-slim

# PyPI's torch is a CUDA build of several GB. The build takes torch from a wheel in ./wheels
# (`cp /opt/wheels/torch-2.13.0+cpu-*.whl wheels/`), or from an index named here:
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# With neither, the build stops instead of quietly installing the CUDA build; pass
# TORCH_INDEX_URL=https://pypi.org/simple to take that one on purpose.
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app

# Layers from the least to the most often changed: torch, then the other dependencies
# (from pyproject.toml alone), then the sources. wheels/ is bind-mounted, not copied, so
# the torch wheel does not stay in a layer of the image.
RUN --mount=type=bind,source=wheels,target=/wheels \
    if [ -n "$TORCH_INDEX_URL" ]; then \
      python3 -m pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0; \
    elif ls /wheels/torch-2.13.0*.whl >/dev/null 2>&1; then \
      # --no-index first: a wheel for another Python or platform fails here rather than
      # letting pip fall back to PyPI's CUDA build; the second call adds torch's dependencies.
      python3 -m pip install --no-index --no-deps --find-links /wheels torch==2.13.0 \
      && python3 -m pip install --find-links /wheels torch==2.13.0; \
    else \
      echo "no torch-2.13.0 wheel in wheels/ and no TORCH_INDEX_URL: see the comment in the Dockerfile" >&2; \
      exit 1; \
    fi \
 && python3 -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('torch', torch.__version__)"
COPY pyproject.toml ./
RUN --mount=type=bind,source=wheels,target=/wheels \
    python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && python3 -m pip install --find-links /wheels -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
COPY README.md ./
COPY protos/ protos/
COPY specdec/ specdec/
COPY verifier_svc/ verifier_svc/
COPY drafter_svc/ drafter_svc/
COPY gateway/ gateway/
RUN python3 -m pip install --no-deps . && rm -rf build *.egg-info

# The default model is downloaded and converted once into this volume.
ENV SPECDEC_CACHE_DIR=/cache
VOLUME /cache
