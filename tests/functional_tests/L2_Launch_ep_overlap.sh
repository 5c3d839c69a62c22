#!/usr/bin/env bash
# Upstream's L2 form: EP overlap through Megatron-Bridge's pretrain() on 2 GPUs (test_pretrain_ep_overlap.py).
# Run from the repository root of a Megatron-Bridge tree with this project (plugin or patch), or with PYTHON set to
# such an environment's interpreter. The test skips, saying why, without 2 GPUs or Transformer Engine.
set -xeuo pipefail
py=${PYTHON:-python}
here=$(cd "$(dirname "$0")" && pwd)
CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 900 "$py" -m torch.distributed.run --nproc_per_node=2 --nnodes=1 \
    -m pytest -o log_cli=true -o log_cli_level=INFO -v -s -x -m "not pleasefixme" --tb=short -rs \
    "$here/training/test_pretrain_ep_overlap.py"
