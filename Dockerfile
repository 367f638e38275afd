# One image for every fGPU Console process (web, manager worker, beat, agent); compose.yaml
# picks the command. The agent on a real GPU node needs the NVIDIA container runtime.
# The processes run as the unprivileged user `fgpu` (uid 10001); compose runs the agent as root
# (it drives the host's Docker Engine through its socket).
# FGPU_BASE_IMAGE: the public python:3.11-slim by default; a machine with no registry (CI) builds
# fgpu-compose-base:bookworm from Debian's packages instead (tests/images/build-compose.sh: the same Python,
# the dependencies already installed and pip pointed at local wheels) and passes it (compose.yaml, README).
ARG FGPU_BASE_IMAGE=python:3.11-slim
FROM ${FGPU_BASE_IMAGE}
# PYTHONPATH: every process imports the code under /app (COPY . . below), never the copy `pip install .`
# left in site-packages, which holds only the packages copied before it (celery -A console found no `usage`).
# DJANGO_SETTINGS_MODULE: set before any process starts, so Celery's Django fixup sees it when the app is
# made (common.celery makes it before console/celery.py sets the default: the manager's tasks then failed
# with AppRegistryNotReady).
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PYTHONPATH=/app DJANGO_SETTINGS_MODULE=console.settings
WORKDIR /app
# iptables: compose's agent guards its sessions' `outbound` network with a chain in the host's tables
# (agent.network; it runs in the host's network namespace with NET_ADMIN). The other processes never call it.
RUN command -v iptables >/dev/null \
    || (apt-get update && apt-get install -y --no-install-recommends iptables && rm -rf /var/lib/apt/lists/*)
COPY pyproject.toml README.md ./
COPY common ./common
COPY console ./console
COPY accelerators ./accelerators
COPY sessions ./sessions
COPY agent ./agent
COPY protocol ./protocol
COPY accounts ./accounts
COPY fgpu_cli ./fgpu_cli
RUN pip install .
COPY . .
RUN FGPU_DATA_DIR=/tmp/build python manage.py collectstatic --noinput >/dev/null
RUN useradd --system --uid 10001 --user-group --home-dir /data --no-create-home fgpu \
    && mkdir -p /data && chown fgpu:fgpu /data && chmod 0750 /data
USER fgpu
EXPOSE 8000
CMD ["uvicorn", "--host", "0.0.0.0", "--port", "8000", "console.asgi:application"]
