# One image for every inferq component: dispatcher, scaler, workers, gateway, CLI.
# The ENTRYPOINT is inferq: every command (compose `command:`, Kubernetes `args:`, the
# containers the scaler launches) holds only inferq's arguments, never `inferq` again
# (tests/redis/test_deploy_commands.py checks each one against this line).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
# docker, kubernetes: the scaler's platforms. gpu: nvidia-ml-py, so a worker on a GPU
# reads its card through NVML (a simulated worker, or one beside a GPU it cannot see,
# is given --vram-mib instead).
RUN pip install ".[docker,kubernetes,gpu,gateway]" && useradd --create-home --uid 10001 inferq
# Numeric, so Kubernetes' runAsNonRoot can verify it. The compose scaler runs as root
# to reach the Docker socket (see docker-compose.yml).
USER 10001

ENTRYPOINT ["inferq"]
CMD ["--help"]
