# megalysses training image for Slurm / Kubernetes GPU clusters: CUDA torch from the base image,
# flash-attn and apex (with its fused CUDA extensions) compiled for Ampere (sm_80) and Hopper (sm_90).
#
#   docker build -t megalysses .                                # hours of CUDA compilation, see MAX_JOBS
#   docker build -t megalysses:lean --build-arg ACCELERATORS=0 .   # without flash-attn and apex: minutes
#   docker run --rm --gpus all --ipc=host megalysses make test     # the suite; CUDA cases run when GPUs are visible
#   docker run --rm --gpus all --ipc=host -v "$PWD/data:/workspace/megalysses/data" \
#       -v "$PWD/runs:/workspace/megalysses/runs" megalysses \
#       torchrun --nproc-per-node 8 pretrain.py --config configs/gpt_1b_32k.yaml
#
# The base brings CUDA 12.8 (nvcc included: a devel image), NCCL, cuDNN and torch 2.11, the torch the
# GPU machines run; FSDP2 with sum-only reductions (parallel.fsdp) needs torch >= 2.8.
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel
FROM ${BASE}

# 1 = build flash-attn and apex into the image, 0 = leave them out
ARG ACCELERATORS=1
# compute capabilities to compile for: 8.0 = A100 (runs on every Ampere), 9.0 = H100/H200
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0"
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
# parallel compile jobs x nvcc threads; each nvcc thread can take ~4 GiB of memory: lower these on small builders
ARG MAX_JOBS=4
ARG NVCC_THREADS=2
ARG FLASH_ATTN_VERSION=2.8.3
# an apex commit (apex publishes no releases to PyPI)
ARG APEX_REF=6424da3b4faa6c8f062da4a48c424fff3f02d42d
# the Python environment of the base image; `make` uses it instead of creating .venv (and for test-gpu)
ARG PYENV=/opt/conda

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VENV=${PYENV} \
    GPU_PYTHON=${PYENV}/bin/python

# make runs the test suite and the quickstart; the official torch images do not ship it.
# Its version is whatever the base's Ubuntu release carries.
# hadolint ignore=DL3008
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*

# accelerators first: they depend on nothing in this repository, so no change here rebuilds them.
# FLASH_ATTENTION_FORCE_BUILD compiles for FLASH_ATTN_CUDA_ARCHS instead of fetching a prebuilt wheel;
# APEX_CPP_EXT / APEX_CUDA_EXT are apex's --cpp_ext / --cuda_ext (amp_C, fused_layer_norm_cuda, ...).
RUN if [ "${ACCELERATORS}" = "1" ]; then \
        pip install "ninja==1.13.2" "psutil>=5.9" "packaging>=23" "wheel>=0.42" \
        && FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" \
           MAX_JOBS="${MAX_JOBS}" NVCC_THREADS="${NVCC_THREADS}" \
           pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}" \
        && APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_PARALLEL_BUILD="${MAX_JOBS}" \
           NVCC_APPEND_FLAGS="--threads ${NVCC_THREADS}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
           pip install --no-build-isolation "apex @ https://github.com/NVIDIA/apex/archive/${APEX_REF}.tar.gz" \
        && python -c "import flash_attn, flash_attn_2_cuda, apex_C, amp_C, fused_layer_norm_cuda; \
                      print('flash-attn', flash_attn.__version__, '+ apex fused extensions built')"; \
    fi

WORKDIR /workspace/megalysses

# the Python dependencies, read from pyproject.toml alone: a code change does not reinstall them.
# numpy<2.4: the interpreter of the base's Triton 3.6 (the kernel tests' path without a GPU) fails on 2.4.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
                  extras = p['optional-dependencies']; \
                  print('\n'.join(p['dependencies'] + [d for e in ('test', 'tensorboard', 'wandb', 'plot') \
                                                       for d in extras[e]]))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "numpy<2.4" \
    && rm /tmp/requirements.txt

COPY . .
# the package itself (console scripts, editable like `make venv`); the stamp tells make it is installed
RUN pip install --no-deps -e . \
    && touch "${VENV}/.installed" "${VENV}/.test"

# a numeric non-root user (uid 1000 may already exist in the base); mount data/ and runs/ as volumes
RUN if ! getent group 1000 > /dev/null; then groupadd --gid 1000 trainer; fi \
    && if ! getent passwd 1000 > /dev/null; then useradd --create-home --uid 1000 --gid 1000 trainer; fi \
    && mkdir -p data runs \
    && chown 1000:1000 . data runs
USER 1000:1000
CMD ["torchrun", "--nproc-per-node", "gpu", "pretrain.py", "--config", "configs/quickstart.yaml"]
