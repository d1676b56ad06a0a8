# llmgw's images (docs/ha.md). NOTE: no image can be built on llmgw's CI machine
# (no container runtime there); deploy/kubernetes is validated offline instead.
#
#   docker build --target llmgw -t ghcr.io/llmgw/llmgw:latest .          routers, control plane
#   docker build --target agent -t ghcr.io/llmgw/llmgw-agent:latest .    node agent + llama.cpp (CUDA)
#
# The agent image carries the engines it launches: llama.cpp's llama-server (CUDA)
# from the llama.cpp project's image. vLLM, SGLang and TensorRT-LLM are large and
# pinned to CUDA and driver versions: build FROM this stage and add the one your
# nodes run, then point engines.<name>.python (or .binary) at it in agent.yaml.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG LLAMA_CPP_IMAGE=ghcr.io/ggml-org/llama.cpp:server-cuda

# -- build the wheel (the compiled data path needs a C compiler; the images don't) --
FROM ${PYTHON_IMAGE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY src ./src
COPY proto ./proto
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# -- routers and control plane --
FROM ${PYTHON_IMAGE} AS llmgw
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent llmgw
USER 10001:10001
EXPOSE 8080 9090 7070
ENTRYPOINT ["llmgw"]
CMD ["serve", "--config", "/etc/llmgw/llmgw.yaml"]

# -- the node agent, with llama-server --
# Built on the llama.cpp CUDA server image (CUDA runtime and cuBLAS in it), with
# Python 3.11 from deadsnakes: llmgw needs >= 3.11, Ubuntu 22.04 ships 3.10.
FROM ${LLAMA_CPP_IMAGE} AS agent
RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
    && add-apt-repository -y ppa:deadsnakes/ppa && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && apt-get purge -y software-properties-common gpg-agent && apt-get autoremove -y \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN python3.11 -m venv /opt/llmgw && /opt/llmgw/bin/pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && ln -s /opt/llmgw/bin/llmgw /usr/local/bin/llmgw \
    && ln -sf /app/llama-server /usr/local/bin/llama-server
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
ENTRYPOINT ["llmgw"]
CMD ["agent", "--config", "/etc/llmgw/agent.yaml"]
