# SPDX-License-Identifier: Apache-2.0
"""CPU DeepSeek-V4 DSpark draft, replacing upstream's stub that raised; the device-agnostic
model is ``vllm/models/deepseek_v4/common/dspark/model.py``."""

from vllm.models.deepseek_v4.common.dspark.model import DSparkDeepseekV4Draft


class DSparkDeepseekV4ForCausalLM(DSparkDeepseekV4Draft):
    """DSpark draft for DeepSeek-V4 on CPU (see ``common/dspark/model.py``)."""


__all__ = ["DSparkDeepseekV4ForCausalLM"]
