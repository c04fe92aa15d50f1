"""The verification harness the demo and the end-to-end tests share.

engine: in-process engines from the recipe; prompts; plain_target: the target without
speculation in a child process; teacher_forcing: the lossless verdict. (Oracle drafts, which
replace the draft model's, live in the test harness: ``tests/support``.)
"""
