# syntax=docker/dockerfile:1
#
# StateBudget planner image.
#   docker build -t statebudget .
#   docker run -p 8000:8000 -v statebudget-data:/data statebudget
# The image runs `statebudget serve` as an unprivileged user; state lives in the /data volume.

ARG PYTHON_IMAGE=python:3.11-slim

# --- builder: build the wheel and install it with its dependencies into a virtual environment ---
# (with the gateway's extra: the same image runs `statebudget gateway`, the Compose file's gateway service)
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
RUN python -m venv /opt/venv
# What the build context carries is decided by .dockerignore (sources, pyproject.toml, setup.py, README.md).
# The planner's hot modules are compiled with mypyc (plans about 1.3x faster, the same plans): a C compiler
# and mypy are needed here only; the runtime stage needs neither. --build-arg STATEBUDGET_COMPILE=0: pure Python.
ARG STATEBUDGET_COMPILE=1
RUN if [ "$STATEBUDGET_COMPILE" = 1 ]; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
      && rm -rf /var/lib/apt/lists/* \
      && python -m pip install "mypy>=2,<3" "setuptools>=70.1" wheel; \
    fi
COPY . .
RUN if [ "$STATEBUDGET_COMPILE" = 1 ]; then isolation=--no-build-isolation; fi \
 && STATEBUDGET_COMPILE=$STATEBUDGET_COMPILE python -m pip wheel --no-deps $isolation --wheel-dir /wheels . \
 && /opt/venv/bin/pip install "$(ls /wheels/statebudget-*.whl)[gateway]" \
 && /opt/venv/bin/statebudget --help > /dev/null \
 && /opt/venv/bin/python -c "import httptools, uvloop" \
 && /opt/venv/bin/python -c "import os, planner_service.planner.greedy as g; assert g.__file__.endswith('.so') == (os.environ['STATEBUDGET_COMPILE'] == '1')"

# --- runtime: the virtual environment on a clean slim image, no compilers, no sources ---
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="statebudget" \
      org.opencontainers.image.description="Control plane that plans where LLM weights, KV cache and MoE experts live in a small GPU cluster"

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLBACKEND=Agg

# A fixed numeric uid/gid so that Kubernetes `runAsNonRoot` can verify it and volume ownership is predictable.
RUN groupadd --system --gid 10001 statebudget \
 && useradd --system --uid 10001 --gid statebudget --home-dir /home/statebudget --create-home \
            --shell /usr/sbin/nologin statebudget \
 && mkdir -p /data \
 && chown statebudget:statebudget /data

COPY --from=builder /opt/venv /opt/venv

# Declared after the chown: a fresh named volume copies this ownership.
VOLUME ["/data"]
WORKDIR /home/statebudget
USER 10001:10001

EXPOSE 8000

# The slim image has no curl: ask /livez with the standard library (a non-2xx answer raises, exit 1).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/livez', timeout=4).status == 200 else 1)"]

ENTRYPOINT ["statebudget"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--db", "/data/statebudget.db"]
