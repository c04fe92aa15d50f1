"""The tiny generated DeepSeek-V4-DSpark checkpoint and its trained draft (CPU demo and tests).

ensure: the checkpoint path, generated and trained on first use; make_tiny_model; checkpoint_quant
(the published FP8/MXFP4 format); draft_twin, target_traces, train_tiny_draft (the draft's training).
"""
