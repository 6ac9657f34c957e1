# One image for every inferq component: dispatcher, scaler, workers, CLI.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install ".[docker,kubernetes]" && useradd --create-home inferq
USER inferq

ENTRYPOINT ["inferq"]
CMD ["--help"]
