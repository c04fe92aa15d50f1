"""The command line every e2e runner without options of its own takes."""

from __future__ import annotations

import argparse


def model_and_out() -> argparse.Namespace:
    """``--model DIR --out FILE``: the checkpoint to serve and where the JSON result goes."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    return ap.parse_args()
