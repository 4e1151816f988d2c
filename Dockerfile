# The image for docker-compose.yml: the library, the example project and its demo.
FROM python:3.12-slim
WORKDIR /app
COPY pyproject.toml README.md LICENSE CHANGELOG.md ./
COPY celery_mongolock ./celery_mongolock
RUN pip install --no-cache-dir '.[test]'
COPY example_project ./example_project
ENV PYTHONPATH=/app/example_project PYTHONUNBUFFERED=1
WORKDIR /app/example_project
