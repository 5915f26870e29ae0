# megalysses training image for Slurm / Kubernetes GPU clusters.
#   docker build -t megalysses .                               # add --build-arg FLASH_ATTN=1 to build flash-attn
#   docker run --gpus all --ipc=host -v $PWD/data:/workspace/megalysses/data megalysses \
#       torchrun --nproc-per-node 8 pretrain.py --config configs/gpt_1b_32k.yaml
# The base image brings CUDA, NCCL and a CUDA build of torch; megalysses only adds pure-Python deps.
# Any torch >= 2.4 trains; parallel.fsdp needs a recent one (FSDP2 with sum-only reductions).
ARG BASE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-devel
FROM ${BASE}

ARG FLASH_ATTN=0
ENV PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /workspace/megalysses
COPY pyproject.toml README.md ./
COPY megalysses ./megalysses
# install the package against the image's torch (the range torch>=2.4 is already satisfied)
RUN pip install -e ".[wandb,plot]" && \
    if [ "$FLASH_ATTN" = "1" ]; then pip install --no-build-isolation "flash-attn>=2.6"; fi
COPY pretrain.py Makefile ./
COPY configs ./configs
COPY tools ./tools
COPY benchmarks ./benchmarks

# a non-root user; mount data/ and runs/ as volumes
RUN useradd --create-home --uid 1000 trainer && mkdir -p data runs && chown -R trainer /workspace/megalysses
USER trainer
CMD ["torchrun", "--nproc-per-node", "gpu", "pretrain.py", "--config", "configs/quickstart.yaml"]
