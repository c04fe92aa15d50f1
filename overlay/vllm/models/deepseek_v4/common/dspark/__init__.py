"""The DeepSeek-V4 DSpark draft model (the checkpoint's ``mtp.*`` weights): ``config``, ``layers``,
``model``, ``markov`` (Markov-head sampling), ``noise`` (seeded draft noise). The V1 proposer
(``vllm.v1.spec_decode.dspark``) drives it; nothing is imported here, so the pure-torch modules
load without the rest of vLLM.
"""
