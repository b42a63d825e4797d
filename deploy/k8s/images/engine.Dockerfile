# The engine image: SGLang plus the Tether agent (torch comes with SGLang). Build from the
# repository root:
#   docker build -f deploy/k8s/images/engine.Dockerfile -t REGISTRY/tether-engine:0.1.0 .
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}
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
# --no-deps for the heavy packages SGLang already pins (torch, transformers); the rest of
# the agent's requirements are small.
RUN pip install --no-cache-dir --no-deps . \
 && pip install --no-cache-dir zstandard numba xxhash fsspec pydantic-settings typer rich \
      httpx boto3 prometheus_client
EXPOSE 8800 30000
ENTRYPOINT []
