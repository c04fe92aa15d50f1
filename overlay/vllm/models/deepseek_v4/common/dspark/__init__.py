"""The DeepSeek-V4 DSpark draft model (the checkpoint's ``mtp.*`` weights).

``config`` reads and checks what the draft needs from the checkpoint config, ``layers``
holds its attention, MoE and mHC layers, ``model`` the draft and its weight loading,
``markov`` the Markov-head block sampling and ``noise`` the seeded draft noise. The V1
proposer (``vllm.v1.spec_decode.dspark``) drives it; nothing here imports the proposer.

Nothing is imported here, so the pure-torch modules load without the rest of vLLM.
"""
