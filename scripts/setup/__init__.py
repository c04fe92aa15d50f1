"""Set-up of the development venv: the recipe's pinned packages (install_deps) and interpreter (find_python.sh)."""
