"""`make rehearse`: the two-Spark launch run for real on one Linux machine (scripts/rehearse.py)."""
