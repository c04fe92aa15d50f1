# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Overlay: on CPU builds without the native DeepSeek-V4 kernels (AVX2-only x86), register
# their torch versions before any DeepSeek-V4 module runs (see torch_ops.py).
from vllm.models.deepseek_v4.cpu.torch_compressor_ops import register_missing_compressor_ops
from vllm.models.deepseek_v4.cpu.torch_ops import register_missing_ops

register_missing_ops()
register_missing_compressor_ops()
