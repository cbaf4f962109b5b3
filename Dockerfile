# One image for all three services; docker-compose.yml picks the command.
# Needs BuildKit (the default builder since Docker 23; `docker compose build` uses it).
#
# Stages: `torch` (Python and torch), `requirements` (the dependency list read from
# pyproject.toml), `kernels` (torch plus a C++ toolchain: compiles specdec's C++ CPU kernels
# ahead of time) and the final image (torch, the other dependencies, the sources and the
# compiled kernels; no compiler). A start of the image compiles nothing. Each stage rebuilds
# only when its own inputs change: an edit to pyproject.toml outside its dependency list
# reinstalls nothing, and only an edit to the kernels' sources recompiles them.
FROM python:3.11-slim AS torch

# PyPI's torch is a CUDA build of several GB. The build takes torch from a wheel in ./wheels
# (copy a CPU build of torch 2.13.0 for CPython 3.11 there, e.g. from
# https://download.pytorch.org/whl/cpu), or from an index named here:
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# With neither, the build stops instead of quietly installing the CUDA build; pass
# TORCH_INDEX_URL=https://pypi.org/simple to take that one on purpose.
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app

# The OpenMP runtime the C++ kernels link against (a shared library, not a compiler).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*

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


FROM torch AS requirements
COPY pyproject.toml /tmp/
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /requirements.txt


# The C++ CPU kernels, compiled here with the same flags, compiler and names as a native
# start's build (specdec/layers/cpu_extension.py). The CPU that builds the image is rarely the one
# that runs it, so every instruction-set variant is built (AVX-512 with and without BF16 and
# VBMI, AVX2, none: about 2 CPU-minutes each) and each start loads the best one its own CPU
# runs. `--build-arg SPECDEC_CPU_VARIANTS=native` builds only the build machine's (faster,
# for an image that runs where it is built); a CPU no variant in the image fits logs so and
# runs the plain-torch paths. Only sources of the kernels enter this stage, so an edit to any
# other file never recompiles them.
FROM torch AS kernels
# Python.h too: python:3.11-slim carries it; an image on the distribution's python3 needs
# python3-dev (never installed over the image's own Python, whose headers would not match).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ ninja-build \
 && if ! python3 -c "import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then \
      apt-get install -y --no-install-recommends python3-dev; \
    fi \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /build
COPY specdec/__init__.py specdec/
COPY specdec/layers/__init__.py specdec/layers/cpu_extension.py specdec/layers/
COPY specdec/layers/csrc/ specdec/layers/csrc/
ARG SPECDEC_CPU_VARIANTS=all
RUN python3 -m specdec.layers.cpu_extension prebuild /opt/specdec/cpu-kernels --variants "$SPECDEC_CPU_VARIANTS"


FROM torch
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN --mount=type=bind,source=wheels,target=/wheels \
    python3 -m pip install --find-links /wheels -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY specdec/ specdec/
COPY verifier_svc/ verifier_svc/
COPY drafter_svc/ drafter_svc/
COPY gateway/ gateway/
RUN python3 -m pip install --no-deps . && rm -rf build *.egg-info
COPY --from=kernels /opt/specdec/cpu-kernels/ /opt/specdec/cpu-kernels/
# Starts load the kernels from here and never compile them. The check fails the build when
# none of them was compiled from the sources installed above.
ENV SPECDEC_CPU_KERNELS_DIR=/opt/specdec/cpu-kernels
RUN cd / && python3 -m specdec.layers.cpu_extension list "$SPECDEC_CPU_KERNELS_DIR"

# The default model is downloaded and converted once into this volume.
ENV SPECDEC_CACHE_DIR=/cache
VOLUME /cache
