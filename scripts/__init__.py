"""Project tools: run files directly (python scripts/recipe.py), packages with -m from the repo root (python -m scripts.bench)."""
