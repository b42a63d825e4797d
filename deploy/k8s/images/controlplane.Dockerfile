# The control plane image (no torch). Build from the repository root:
#   docker build -f deploy/k8s/images/controlplane.Dockerfile -t REGISTRY/tether-controlplane:0.1.0 .
FROM python:3.12-slim
WORKDIR /opt/tether
COPY pyproject.toml README.md ./
COPY store ./store
COPY controlplane ./controlplane
COPY engine_agent ./engine_agent
COPY trainer_client ./trainer_client
COPY sandboxes ./sandboxes
COPY wire ./wire
COPY reference_engine ./reference_engine
COPY launcher ./launcher
COPY demo ./demo
COPY cli ./cli
COPY deploy ./deploy
COPY bench ./bench
RUN pip install --no-cache-dir '.[controlplane,s3]'
USER 65534
EXPOSE 8700
ENTRYPOINT []
CMD ["tether", "controlplane", "serve", "--host", "0.0.0.0", "--port", "8700"]
