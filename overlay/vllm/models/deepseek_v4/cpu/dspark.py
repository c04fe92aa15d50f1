# SPDX-License-Identifier: Apache-2.0
"""CPU DeepSeek-V4 DSpark draft model (replaces the upstream stub that raised).

The model registry resolves ``DSparkDraftModel`` to ``DSparkDeepseekV4ForCausalLM`` from
this module on the CPU platform. The implementation is device-agnostic and lives in
``vllm/models/deepseek_v4/common/dspark/model.py``; on CPU it runs vLLM's CPU kernels for
the linear layers, the mHC ops and the MoE, and plain torch for the block attention over
the draft's private per-request KV ring.
"""

from vllm.models.deepseek_v4.common.dspark.model import DSparkDeepseekV4Draft


class DSparkDeepseekV4ForCausalLM(DSparkDeepseekV4Draft):
    """DSpark draft for DeepSeek-V4 on CPU (see ``common/dspark/model.py``)."""


__all__ = ["DSparkDeepseekV4ForCausalLM"]
