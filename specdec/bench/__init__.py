"""The benchmark commands of `python -m specdec bench ...`."""
