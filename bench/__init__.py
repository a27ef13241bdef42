"""runwarden benchmark: runwarden against the floors of the parts it is made of, in one run.

Run `python -m bench` from the repository root (see bench/README.md).
"""
