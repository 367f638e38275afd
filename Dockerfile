# One image for every fGPU Console process (web, manager worker, beat, agent); compose.yaml
# picks the command. The agent on a real GPU node needs the NVIDIA container runtime.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
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
EXPOSE 8000
CMD ["uvicorn", "--host", "0.0.0.0", "--port", "8000", "console.asgi:application"]
